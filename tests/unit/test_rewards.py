"""Reward hub: math answer extraction/equivalence, built-in reward types, custom reward functions, scoring."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from miles.rollout.rm_hub import (
    RewardContext,
    RewardScorer,
    get_reward_fn,
    load_custom_rm,
    register_reward,
    reward_types,
    score_samples,
)
from miles.rollout.rm_hub.math_utils import extract_answer, is_equiv, last_boxed_content, math_reward
from miles.utils.types import Sample, SampleStatus


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_last_boxed_content(text: str, expected: str | None) -> None:
    assert last_boxed_content(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 12.", "12"),
        ("answer: x+1", "x+1"),
        ("first 3 then 4 and finally -5", "-5"),
        ("about 1,234 apples", "1,234"),
        ("ratio 3/4", "3/4"),
        ("nothing numeric", None),
        ("", None),
        ("\\boxed{9} although the answer is 8", "9"),  # boxed wins over "answer is"
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("Thus \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}", 1.0),  # dfrac -> frac
        ("Thus \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fraction vs decimal
        ("Thus \\boxed{1/2}", "\\frac12", 1.0),  # a/b vs \frac12
        ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),  # negative fraction
        ("\\boxed{-3}", "-3", 1.0),
        ("\\boxed{-3}", "3", 0.0),  # sign matters
        ("\\boxed{2.50}", "2.5", 1.0),  # decimals numerically
        ("\\boxed{1,000}", "1000", 1.0),  # comma thousands
        ("\\boxed{50\\%}", "50", 1.0),  # percentage
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),  # \text{} unwrapped
        ("$\\boxed{\\left( 1, 2 \\right)}$", "(1,2)", 1.0),  # \left/\right and spaces
        ("\\boxed{x^2 + 1}", "x^2+1", 1.0),  # symbolic: string equality after normalisation
        ("\\boxed{x^2 + 2}", "x^2+1", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),  # not within tolerance
        ("The answer is 7.", "7", 1.0),
        ("I think 3 or maybe 7", "7", 1.0),  # last number fallback
        ("I think 7 or maybe 3", "7", 0.0),
        ("no idea", "7", 0.0),  # no answer at all
        ("\\boxed{5}", 5, 1.0),  # integer label
        ("\\boxed{5}", "\\boxed{5}", 1.0),  # boxed label is unwrapped
        ("\\boxed{1/0}", "1", 0.0),  # division by zero is just not a number
    ],
)
def test_math_reward_table(response: str, label: object, reward: float) -> None:
    assert math_reward(response, label) == reward


def test_is_equiv_is_symmetric_on_numbers() -> None:
    for a, b in [("0.5", "\\frac{1}{2}"), ("1,234.5", "1234.50"), ("-2/4", "-0.5")]:
        assert is_equiv(a, b) and is_equiv(b, a)


def _sample(response: str, label: object, index: int = 0) -> Sample:
    return Sample(index=index, response=response, label=label)


def test_builtin_types_registered() -> None:
    assert {"math", "deepscaler", "exact_match"} <= set(reward_types())


def test_get_reward_fn_unknown_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown --rm-type 'nope'.*deepscaler.*exact_match.*math"):
        get_reward_fn("nope")


def test_duplicate_registration_rejected() -> None:
    with pytest.raises(ValueError, match="'math' is already registered"):
        register_reward("math")(lambda args, sample: 1.0)


def test_math_and_exact_match() -> None:
    math_fn, em = get_reward_fn("math"), get_reward_fn("exact_match")
    assert math_fn(None, _sample("so \\boxed{4}", "4")) == 1.0
    assert math_fn(None, _sample("so \\boxed{5}", "4")) == 0.0
    assert em(None, _sample("  Paris \n", "Paris")) == 1.0
    assert em(None, _sample("paris", "Paris")) == 0.0
    assert em(None, _sample("Paris.", "Paris")) == 0.0
    assert em(None, _sample("3", 3)) == 1.0
    with pytest.raises(ValueError, match="needs a label"):
        em(None, _sample("3", None))


def test_deepscaler() -> None:
    """The reference's rule: only the boxed answer after `</think>` (or `###Response`) counts; neither marker: 0."""
    fn = get_reward_fn("deepscaler")
    assert fn(None, _sample("<think>maybe \\boxed{3}</think> so \\boxed{4}", "4")) == 1.0
    assert fn(None, _sample("<think>\\boxed{4}</think> so \\boxed{3}", "4")) == 0.0  # only after </think>
    assert fn(None, _sample("a</think>b</think> \\boxed{4}", "4")) == 1.0  # after the last one
    assert fn(None, _sample("<think>still thinking \\boxed{4}", "4")) == 0.0  # never closed
    # No marker at all: 0, even with the right boxed answer (math would give 1.0 here).
    assert fn(None, _sample("\\boxed{4}", "4")) == 0.0
    assert get_reward_fn("math")(None, _sample("\\boxed{4}", "4")) == 1.0
    # ###Response (the base-model prompt format) marks the final part when there is no </think>.
    assert fn(None, _sample("draft \\boxed{3}\n###Response\nso \\boxed{4}", "4")) == 1.0
    assert fn(None, _sample("draft \\boxed{4}\n###Response\nso \\boxed{3}", "4")) == 0.0
    # Only a boxed answer counts, as in the reference: "the answer is 4" or a last number score 0.
    assert fn(None, _sample("<think>x</think> The answer is 4", "4")) == 0.0
    assert fn(None, _sample("<think>x</think> \\boxed{\\frac{1}{2}}", "0.5")) == 1.0
    assert fn(None, _sample("<think>x</think> \\boxed{4}", "\\boxed{4}")) == 1.0  # a boxed label is unwrapped
    with pytest.raises(ValueError, match="needs a label"):
        fn(None, _sample("no marker", None))


@pytest.fixture
def rm_module(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """A user module with sync, async, raising and badly-typed reward functions on sys.path."""
    (tmp_path / "user_rm_mod.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def sync_rm(args, sample):
                return 1.0 if sample.response == sample.label else 0.0

            async def async_rm(args, sample):
                await asyncio.sleep(0)
                return sample.response == sample.label  # bool is coerced

            def raising_rm(args, sample):
                if sample.index == 1:
                    raise KeyError("boom")
                return args.max_response_len / 8

            def nan_rm(args, sample):
                return float("nan")

            def str_rm(args, sample):
                return "1.0"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rm_mod"
    sys.modules.pop("user_rm_mod", None)


def test_custom_rm_sync_and_async(rm_module: str) -> None:
    for fn in ("sync_rm", "async_rm"):
        samples = [_sample("a", "a", 0), _sample("b", "a", 1)]
        scores, failed = asyncio.run(
            score_samples(samples, None, f"{rm_module}:{fn}", None, error_as_zero=False)
        )
        assert scores == [1.0, 0.0] and failed == 0
        assert all(isinstance(s, float) for s in scores)


def test_custom_rm_overrides_rm_type(rm_module: str) -> None:
    scores, _ = asyncio.run(score_samples([_sample("x", "x")], "math", f"{rm_module}:sync_rm", None, False))
    assert scores == [1.0]  # math would give 0.0: no number in "x"


def test_custom_rm_import_errors(rm_module: str) -> None:
    with pytest.raises(ValueError, match="--custom-rm-path.*no_such_module_xyz"):
        load_custom_rm("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="--custom-rm-path.*no attribute 'missing'"):
        load_custom_rm(f"{rm_module}:missing")


def test_raising_rm_raises_with_path_and_index(rm_module: str) -> None:
    samples = [_sample("a", "a", 0), _sample("b", "a", 1)]
    with pytest.raises(RuntimeError, match=rf"{rm_module}:raising_rm.*sample index 1") as info:
        asyncio.run(
            score_samples(samples, None, f"{rm_module}:raising_rm", RewardContext(max_response_len=4), False)
        )
    assert isinstance(info.value.__cause__, KeyError)


def test_raising_rm_error_as_zero(rm_module: str) -> None:
    samples = [_sample("a", "a", 0), _sample("b", "a", 1), _sample("c", "a", 2)]
    scores, failed = asyncio.run(
        score_samples(samples, None, f"{rm_module}:raising_rm", RewardContext(max_response_len=4), True)
    )
    assert scores == [0.5, 0.0, 0.5] and failed == 1
    assert [s.status for s in samples] == [SampleStatus.PENDING, SampleStatus.FAILED, SampleStatus.PENDING]


@pytest.mark.parametrize("fn", ["nan_rm", "str_rm"])
def test_non_finite_or_non_float_rewards_rejected(rm_module: str, fn: str) -> None:
    with pytest.raises(ValueError, match=rf"{rm_module}:{fn}.*finite float"):
        asyncio.run(score_samples([_sample("a", "a")], None, f"{rm_module}:{fn}", None, error_as_zero=True))


def test_score_samples_builtin_and_no_rm() -> None:
    samples = [_sample("\\boxed{2}", "2", 0), _sample("\\boxed{3}", "2", 1)]
    assert asyncio.run(score_samples(samples, "math", None, None, False)) == ([1.0, 0.0], 0)
    with pytest.raises(RuntimeError, match="sample index 0.*set --rm-type, --custom-rm-path or --rm-url"):
        asyncio.run(score_samples([_sample("x", "x")], None, None, None, False))


@pytest.mark.parametrize(
    ("response", "label", "score"),
    [
        ("reasoning...\nAnswer: 42", "42", 1.0),
        ("Answer: 1,000", "1000", 1.0),  # thousands separator
        ("Answer: $\\boxed{7}$", "7.0", 1.0),  # wrappers dropped; an integer label compares as an integer
        ("x = 5\nAnswer: x = 6", "6", 1.0),  # the text after the last '='
        ("Answer: 41", "42", -1.0),
        ("the result is 42", "42", -1.0),  # no "Answer:" line
        ("Answer: 3\n" + "filler " * 60 + "Answer: 4", "3", -1.0),  # only the last 300 characters count
    ],
)
def test_dapo_reward(response: str, label: str, score: float) -> None:
    out = get_reward_fn("dapo")(RewardContext(), _sample(response, label))
    assert out == {"score": score, "acc": float(score > 0)}


@pytest.mark.parametrize(
    ("response", "label", "f1"),
    [
        ("The Eiffel Tower", "eiffel tower", 1.0),  # case, article
        ("Paris, France", "Paris", 2 * (1 / 2 * 1) / (1 / 2 + 1)),  # precision 1/2, recall 1
        ("London", "Paris", 0.0),
        ("", "", 1.0),
        ("Paris", ["Lyon", "paris!"], 1.0),  # best of several labels
    ],
)
def test_f1_reward(response: str, label: object, f1: float) -> None:
    assert get_reward_fn("f1")(RewardContext(), _sample(response, label)) == pytest.approx(f1)


@pytest.mark.parametrize(
    ("response", "label", "metadata", "reward"),
    [
        ("The answer is (C).", "C", {}, 1.0),
        ("Answer: b", "B", {}, 1.0),
        ("I pick option D", "C", {}, 0.0),
        ("<think>maybe A</think> so B", "B", {}, 1.0),  # only after </think>
        ("Final: A", 0, {"choices": ["4", "5", "6"]}, 1.0),  # label as an index
        ("The answer is B", "five", {"choices": ["four", "five"]}, 1.0),  # label as the choice text
        ("The answer is E", "A", {"choices": ["1", "2", "3"]}, 0.0),  # E is not a valid letter here
    ],
)
def test_gpqa_reward(response: str, label: object, metadata: dict, reward: float) -> None:
    sample = Sample(response=response, label=label, metadata=metadata)
    assert get_reward_fn("gpqa")(RewardContext(), sample) == reward


def test_boxed_prefix_and_per_sample_rm_type() -> None:
    samples = [
        Sample(index=0, response="blah \\boxed{Paris}", label="Paris"),  # --rm-type boxed_exact_match
        Sample(index=1, response="Paris", label="Paris"),  # no box: scores the empty string
        Sample(index=2, response="so \\boxed{4}", label="4", metadata={"rm_type": "math"}),
        Sample(index=3, response="Answer: 4", label="4", metadata={"rm_type": "dapo"}),
    ]
    rewards, failed = asyncio.run(score_samples(samples, "boxed_exact_match", None, None, False))
    assert rewards == [1.0, 0.0, 1.0, {"score": 1.0, "acc": 1.0}] and failed == 0
    assert samples[0].response == "blah \\boxed{Paris}"  # the sample itself is not rewritten
    with pytest.raises(ValueError, match="'boxed_' prefix is reserved"):
        register_reward("boxed_x")


def test_dict_reward_needs_reward_key() -> None:
    sample = Sample(index=5, reward={"score": -1.0, "acc": 0.0})
    assert sample.reward_value("score") == -1.0
    with pytest.raises(ValueError, match="sample 5.*set --reward-key"):
        sample.reward_value(None)
    with pytest.raises(ValueError, match="--reward-key 'nope' not in reward"):
        sample.reward_value("nope")


def test_dict_reward_without_reward_key_names_the_function(tmp_path, monkeypatch) -> None:
    (tmp_path / "user_dict_rm.py").write_text(
        "def both(ctx, sample):\n    return {'score': 1.0, 'acc': 0.0}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = RewardScorer(RewardContext(), "user_dict_rm:both")
    samples = [Sample(index=3, response="x")]
    asyncio.run(scorer.score(samples))
    with pytest.raises(ValueError, match=r"reward function --custom-rm-path=user_dict_rm:both: sample 3: .*"
                       r"dict with keys \['acc', 'score'\]; set --reward-key"):  # fmt: skip
        scorer.set_train_rewards(samples)
    wrong = RewardScorer(RewardContext(reward_key="nope"), "user_dict_rm:both")
    with pytest.raises(ValueError, match="--custom-rm-path=user_dict_rm:both: .*--reward-key 'nope' not in"):
        wrong.set_train_rewards(samples)
    builtin = RewardScorer(RewardContext(rm_type="math"))
    dapo = [Sample(index=0, response="Answer: 4", label="4", metadata={"rm_type": "dapo"})]
    asyncio.run(builtin.score(dapo))
    with pytest.raises(ValueError, match=r"reward function rm_type dapo \(the sample's metadata\): sample 0"):
        builtin.set_train_rewards(dapo)
    RewardScorer(RewardContext(reward_key="score"), "user_dict_rm:both").set_train_rewards(samples)
    assert samples[0].train_reward == 1.0


def test_group_rm_and_post_process(tmp_path, monkeypatch) -> None:
    (tmp_path / "user_group_rm.py").write_text(
        textwrap.dedent(
            """
            def rank_in_group(ctx, samples):
                order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
                return [float(order.index(i)) for i in range(len(samples))]

            def centered(ctx, samples):
                mean = sum(s.reward for s in samples) / len(samples)
                return [s.reward - mean for s in samples]

            def wrong_length(ctx, samples):
                return [1.0]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    group = [_sample("ccc", None, 0), _sample("a", None, 1), _sample("bb", None, 2)]
    calls = []
    scorer = RewardScorer(RewardContext(), "user_group_rm:rank_in_group", group_rm=True,
                          post_process_path="user_group_rm:centered")  # fmt: skip
    original = scorer.custom
    scorer.custom = lambda ctx, samples: calls.append(len(samples)) or original(ctx, samples)
    assert asyncio.run(scorer.score(group)) == 0
    assert calls == [3] and [s.reward for s in group] == [2.0, 0.0, 1.0]  # one call for the whole group
    scorer.set_train_rewards(group)
    assert [s.train_reward for s in group] == [1.0, -1.0, 0.0] and [s.scalar_reward() for s in group] == [
        1,
        -1,
        0,
    ]
    bad = RewardScorer(RewardContext(), "user_group_rm:wrong_length", group_rm=True)
    with pytest.raises(ValueError, match="returned list of length 1 for a group of 3 samples"):
        asyncio.run(bad.score([_sample("x", None, i) for i in range(3)]))
    with pytest.raises(ValueError, match="--custom-reward-post-process-path.*user_group_rm:missing"):
        RewardScorer(RewardContext(rm_type="math"), post_process_path="user_group_rm:missing")
    sys.modules.pop("user_group_rm", None)


def test_a_hung_reward_function_expires_naming_it(tmp_path, monkeypatch) -> None:
    """--reward-timeout bounds each call, sync (run in a thread) or async, per sample or per group; the error
    names the function, the sample(s) and the flag. A function raising TimeoutError itself is its own error."""
    (tmp_path / "user_slow_rm.py").write_text(
        textwrap.dedent(
            """
            import asyncio, threading

            def hangs(ctx, sample):
                threading.Event().wait()

            async def hangs_async(ctx, sample):
                await asyncio.Event().wait()

            def hangs_group(ctx, samples):
                threading.Event().wait()

            def own_timeout(ctx, sample):
                raise TimeoutError("the judge service timed out")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, group_rm in [("hangs", False), ("hangs_async", False), ("hangs_group", True)]:
        scorer = RewardScorer(RewardContext(), f"user_slow_rm:{name}", group_rm=group_rm, timeout=0.2)
        with pytest.raises(TimeoutError, match=rf"reward function --custom-rm-path=user_slow_rm:{name} gave no "
                           r"answer within 0.2s \(--reward-timeout\) for .*(sample index |indices \[)7"):  # fmt: skip
            asyncio.run(scorer.score([_sample("x", None, 7), _sample("y", None, 8)]))
        # the hung calls above never end: the error itself shows the scorer stopped waiting for them
    lenient = RewardScorer(RewardContext(), "user_slow_rm:hangs", error_as_zero=True, timeout=0.2)
    group = [_sample("x", None, 0), _sample("y", None, 1)]
    assert asyncio.run(lenient.score(group)) == 2  # with --rm-error-as-zero an expired call is a failure
    assert [(s.reward, s.status) for s in group] == [(0.0, SampleStatus.FAILED)] * 2
    own = RewardScorer(RewardContext(), "user_slow_rm:own_timeout", timeout=5)
    with pytest.raises(RuntimeError, match="failed on sample index 3.*TimeoutError: the judge service"):
        asyncio.run(own.score([_sample("x", None, 3)]))
    with pytest.raises(ValueError, match="--reward-timeout must be > 0"):
        RewardScorer(RewardContext(rm_type="math"), timeout=0)
    sys.modules.pop("user_slow_rm", None)
