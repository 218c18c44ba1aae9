"""The bad-input catalog (issue 8): each entry feeds one bad input to a real entry point and checks that the error
names its culprit (the flag, the file, the line) and that nothing half-written is left behind.

Two kinds of entries, both `Bad(name, expect, ...)`:
- `argv=`: flags for `miles.train.main` (the CLI entry point, in-process) on top of a valid launch line; the
  run must exit 2 from validation or pre-flight, before anything starts, with every `expect` fragment on
  stderr, and must not create its run directory.
- `call=`: any other entry point (data set, checkpoint, model loading, reward scoring, ...); it must raise, and
  the exception text must contain every `expect` fragment.
After each entry no `*.tmp` file or directory may remain in the entry's scratch directory.

To add a case (e.g. an engine HTTP contract entry), append a `Bad` to CATALOG; `World` offers a scratch
directory, a valid tiny model and data set, file writers and a saved checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from miles.backends.fsdp_utils.checkpoint import TRACKER_FILE, load_checkpoint, save_checkpoint
from miles.backends.fsdp_utils.hf_load import load_hf_model
from miles.rollout.data_source import PromptDataset
from miles.rollout.rm_hub import score_samples
from miles.utils.types import Sample

REPO = Path(__file__).resolve().parents[2]


@dataclass
class World:
    """What an entry may use: `tmp` (its own scratch dir), a valid `model` dir and `data` file (shared, read
    only), the valid launch line `base`, and helpers that write bad copies into `tmp`."""

    tmp: Path
    model: str
    data: str
    tokenizer: object

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    @property
    def base(self) -> list[str]:
        return [
            "--hf-checkpoint", self.model, "--prompt-data", self.data, "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "math", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--colocate", "--run-dir", str(self.run_dir), "--dry-run",
        ]  # fmt: skip

    def without(self, flag: str, takes_value: bool = True) -> list[str]:
        argv = list(self.base)
        i = argv.index(flag)
        del argv[i : i + (2 if takes_value else 1)]
        return argv

    def write(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def rows(self, name: str, rows: list) -> str:
        return self.write(name, "".join(json.dumps(r) + "\n" for r in rows))

    def module(self, name: str, source: str) -> str:
        """Write an importable module `name` (the runner puts tmp/mods on sys.path); returns `name`."""
        self.write(f"mods/{name}.py", textwrap.dedent(source))
        return name

    def model_copy(self, change: Callable[[Path], object] = lambda p: None) -> str:
        path = self.tmp / "model"
        shutil.copytree(self.model, path)
        change(path)
        return str(path)

    def checkpoint(self, change: Callable[[Path], object] = lambda p: None) -> str:
        """A checkpoint root holding rollout 0 of `torch.nn.Linear(4, 4)` (seed 0), after `change(iter_dir)`."""
        root = self.tmp / "ckpt"
        torch.manual_seed(0)
        save_checkpoint(root, 0, torch.nn.Linear(4, 4), None, None)
        change(root / "iter_0000000")
        return str(root)


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def _first(directory: Path, pattern: str) -> Path:
    return sorted(directory.glob(pattern))[0]


def _load_linear(root: str, shape: tuple[int, int] = (4, 4)) -> None:
    load_checkpoint(root, torch.nn.Linear(*shape), None, None)


def _dataset(w: World, path: str, **kw) -> PromptDataset:
    args = dict(input_key="prompt", label_key="label", metadata_key=None, tokenizer=w.tokenizer)
    return PromptDataset(path, **{**args, "apply_chat_template": False, **kw})


def _score(w: World, source: str, responses: tuple[str, ...] = ("1", "2")) -> None:
    name = w.module(f"catalog_rm_{abs(hash(source)) % 10**8}", source)
    samples = [Sample(index=i, response=r, label="1") for i, r in enumerate(responses)]
    asyncio.run(score_samples(samples, None, f"{name}:score", None, error_as_zero=False))


_ENGINE: dict[
    str, object
] = {}  # one in-process embedded engine for the engine-HTTP entries (built on first use)


def _engine_app(w: World) -> object:
    """The embedded engine's FastAPI app over the shared tiny model (its scheduler thread stops at exit)."""
    if w.model not in _ENGINE:
        import atexit

        from miles.engines.local.engine import LocalEngine, LocalEngineConfig
        from miles.engines.local.server import create_app

        engine = LocalEngine(LocalEngineConfig(model_path=w.model, max_running_requests=4))
        engine.start()
        atexit.register(engine.stop)
        _ENGINE[w.model] = create_app(engine, request_timeout=60, admin_timeout=30)
    return _ENGINE[w.model]


def _engine_post(
    w: World, path: str, body: object, *, before: tuple[str, ...] = (), after: tuple = ()
) -> None:
    """POST `body` (raw bytes, or JSON) to the in-process engine (after the POSTs `before`, then `after`);
    raises naming the status and the answer unless it is 200."""
    import httpx

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_engine_app(w))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            for other in before:
                (await client.post(other, json={})).raise_for_status()
            try:
                if isinstance(body, bytes):
                    return await client.post(path, content=body, headers={"Content-Type": "application/json"})
                return await client.post(path, json=body)
            finally:
                for other in after:
                    await client.post(other, json={})

    resp = asyncio.run(go())
    if resp.status_code != 200:
        raise RuntimeError(f"engine {path} answered {resp.status_code}: {resp.text}")


def _context_len(w: World) -> int:
    return int(json.loads((Path(w.model) / "config.json").read_text())["max_position_embeddings"])


def _hung_reward(w: World) -> None:
    from miles.rollout.rm_hub import RewardContext, RewardScorer

    name = w.module(
        "catalog_rm_hangs", "import threading\ndef score(args, s):\n    threading.Event().wait()\n"
    )
    scorer = RewardScorer(RewardContext(), f"{name}:score", timeout=0.3)
    asyncio.run(scorer.score([Sample(index=4, response="1", label="1")]))


def _full_disk_save(w: World) -> None:
    """Save onto a 512 KiB tmpfs (private mount namespace); the child reports the error and what is left."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a small tmpfs")
    mnt = w.tmp / "small"
    mnt.mkdir()
    script = textwrap.dedent(
        """
        import sys, torch
        from pathlib import Path
        from miles.backends.fsdp_utils.checkpoint import save_checkpoint
        root = Path(sys.argv[1]) / "ckpt"
        try:
            save_checkpoint(root, 0, torch.nn.Linear(512, 512), None, None)
        except Exception as e:
            left = sorted(str(p) for p in Path(sys.argv[1]).rglob("*.tmp"))
            print(f"{type(e).__name__}: {e}", "| no .tmp left" if not left else f"| left: {left}")
            sys.exit(3)
        """
    )
    cmd = f'mount -t tmpfs -o size=512k tmpfs "$1" && exec "{sys.executable}" -c "$2" "$1"'
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", cmd, "sh", str(mnt), script], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    if proc.returncode not in (0, 3):
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[-300:]}")
    raise RuntimeError(proc.stdout + proc.stderr)


@dataclass(frozen=True)
class Bad:
    name: str
    expect: tuple[str, ...]
    argv: Callable[[World], list[str]] | None = None
    call: Callable[[World], object] | None = None


CHAT = [{"role": "user", "content": "hi"}]
CATALOG = [
    # ---- flags: validation (no file is read) ------------------------------------------------------------
    Bad("lr_inf", ("--lr=inf", "finite"), argv=lambda w: w.base + ["--lr", "inf"]),
    Bad("lr_nan", ("--lr='nan'", "NaN"), argv=lambda w: w.base + ["--lr", "nan"]),
    Bad("eps_clip_inf", ("--eps-clip=inf",), argv=lambda w: w.base + ["--eps-clip", "inf"]),
    Bad("timeout_inf", ("--rollout-request-timeout=inf",), argv=lambda w: w.base + ["--rollout-request-timeout=inf"]),
    Bad("unknown_flag", ("--learning-rate", "unknown flag"), argv=lambda w: w.base + ["--learning-rate", "1e-5"]),
    Bad("bad_choice", ("--advantage-estimator='grpoo'",), argv=lambda w: w.base + ["--advantage-estimator", "grpoo"]),
    Bad("zero_batch", ("--rollout-batch-size=0",), argv=lambda w: w.base + ["--rollout-batch-size", "0"]),
    Bad("gbs_not_dividing", ("--global-batch-size=3", "must divide"), argv=lambda w: w.base + ["--global-batch-size", "3"]),
    Bad("public_host_no_key", ("--engine-host='0.0.0.0'", "--engine-api-key"), argv=lambda w: w.base + ["--engine-host", "0.0.0.0"]),
    Bad("rm_path_syntax", ("--custom-rm-path='not a path'",), argv=lambda w: w.base + ["--custom-rm-path", "not a path"]),
    Bad("config_missing", ("--config=", "none.yaml", "cannot read"), argv=lambda w: w.base + ["--config", str(w.tmp / "none.yaml")]),
    Bad("config_unknown_key", ("run.yaml", "learning_rate"), argv=lambda w: w.base + ["--config", w.write("run.yaml", "learning_rate: 1\n")]),
    Bad("env_vars_json", ("--train-env-vars", "invalid JSON"), argv=lambda w: w.base + ["--train-env-vars", "{x"]),
    Bad("router_flag_unknown", ("--router-cache-treshold='0.3'", "sglang-router has no such option"), argv=lambda w: w.base + ["--router-cache-treshold", "0.3"]),
    Bad("router_flag_value", ("--router-cache-threshold='high'", "sglang-router refuses"), argv=lambda w: w.base + ["--router-cache-threshold", "high"]),
    Bad("router_policy", ("--router-policy='fastest'", "round_robin"), argv=lambda w: w.base + ["--router-policy", "fastest"]),
    Bad("external_engine_addr", ("--rollout-external-engine-addrs", "'host-a'", "HOST:PORT"), argv=lambda w: w.base + ["--rollout-external-engine-addrs", "host-a"]),
    # ---- flags: pre-flight (imports, unbuilt features) --------------------------------------------------
    Bad("health_check_timeout_zero", ("--rollout-health-check-timeout=0",), argv=lambda w: w.base + ["--use-fault-tolerance", "--rollout-health-check-timeout", "0"]),
    Bad("no_reward", ("no reward function", "--rm-type", "--custom-rm-path"), argv=lambda w: w.without("--rm-type")),
    Bad("unknown_rm_type", ("--rm-type='mathh'", "did you mean 'math'"), argv=lambda w: w.base + ["--rm-type", "mathh"]),
    Bad("rm_module_missing", ("--custom-rm-path='no_such_mod:fn'", "No module named"), argv=lambda w: w.base + ["--custom-rm-path", "no_such_mod:fn"]),
    Bad("rm_attr_missing", ("--custom-rm-path='cat_rm_a:nope'", "no attribute 'nope'"), argv=lambda w: w.base + ["--custom-rm-path", w.module("cat_rm_a", "x = 1") + ":nope"]),
    Bad("rm_not_callable", ("--custom-rm-path='cat_rm_b:x'", "not callable"), argv=lambda w: w.base + ["--custom-rm-path", w.module("cat_rm_b", "x = 1") + ":x"]),
    Bad("rm_import_raises", ("--custom-rm-path='cat_rm_c:f'", "RuntimeError: boom"), argv=lambda w: w.base + ["--custom-rm-path", w.module("cat_rm_c", "raise RuntimeError('boom')") + ":f"]),
    Bad("loss_path_missing", ("--custom-loss-function-path='nomod:f'",), argv=lambda w: w.base + ["--custom-loss-function-path", "nomod:f"]),
    Bad("advantage_path_missing", ("--custom-advantage-function-path='nomod.sub:f'",), argv=lambda w: w.base + ["--custom-advantage-function-path", "nomod.sub:f"]),
    Bad("tis_path_attr", ("--custom-tis-function-path='cat_tis:g'", "no attribute 'g'"), argv=lambda w: w.base + ["--custom-tis-function-path", w.module("cat_tis", "def f(): pass") + ":g"]),
    # ---- files: prompt and eval data (first row, before anything starts) -------------------------------
    Bad("data_missing", ("--prompt-data", "nope.jsonl", "does not exist"), argv=lambda w: w.base + ["--prompt-data", str(w.tmp / "nope.jsonl")]),
    Bad("data_suffix", ("--prompt-data", "d.csv", "unsupported suffix"), argv=lambda w: w.base + ["--prompt-data", w.write("d.csv", "a,b\n")]),
    Bad("data_not_json", ("bad.jsonl: line 2", "not valid JSON"), argv=lambda w: w.base + ["--prompt-data", w.write("bad.jsonl", "\n{prompt: 1}\n")]),
    Bad("data_input_key", ("--prompt-data", "line 1", "missing key 'question'"), argv=lambda w: w.base + ["--input-key", "question"]),
    Bad("data_label_key", ("--prompt-data", "line 1", "missing key 'answer'"), argv=lambda w: w.base + ["--label-key", "answer"]),
    Bad("data_not_utf8", ("latin1.jsonl: line 1", "not valid UTF-8"), argv=lambda w: w.base + ["--prompt-data", w.write("latin1.jsonl", b'{"prompt": "caf\xe9", "label": "1"}\n')]),
    Bad("data_row_list", ("list.jsonl: line 1", "expected a JSON object, got list"), argv=lambda w: w.base + ["--prompt-data", w.rows("list.jsonl", [[1, 2]])]),
    Bad("data_chat_without_template", ("chat.jsonl: line 1", "--apply-chat-template"), argv=lambda w: w.without("--apply-chat-template", False) + ["--prompt-data", w.rows("chat.jsonl", [{"prompt": CHAT, "label": "1"}])]),
    Bad("data_bad_messages", ("msgs.jsonl: line 1", "'role' and 'content'"), argv=lambda w: w.base + ["--prompt-data", w.rows("msgs.jsonl", [{"prompt": [{"text": "hi"}], "label": "1"}])]),
    Bad("data_empty", ("--prompt-data", "empty.jsonl has no rows"), argv=lambda w: w.base + ["--prompt-data", w.write("empty.jsonl", "\n\n")]),
    Bad("data_is_dir", ("--prompt-data", "is not a file"), argv=lambda w: w.base + ["--prompt-data", str(w.tmp)]),
    Bad("eval_missing", ("--eval-prompt-data aime", "none.jsonl", "does not exist"), argv=lambda w: w.base + ["--eval-prompt-data", "aime", str(w.tmp / "none.jsonl")]),
    Bad("eval_missing_label", ("--eval-prompt-data aime", "ev.jsonl: line 1", "missing key 'label'"), argv=lambda w: w.base + ["--eval-prompt-data", "aime", w.rows("ev.jsonl", [{"prompt": "x"}])]),
    # ---- files: the model directory ---------------------------------------------------------------------
    Bad("model_missing", ("--hf-checkpoint=", "nomodel", "does not exist"), argv=lambda w: w.base + ["--hf-checkpoint", str(w.tmp / "nomodel")]),
    Bad("model_is_file", ("--hf-checkpoint=", "is a file"), argv=lambda w: w.base + ["--hf-checkpoint", w.write("m.bin", "x")]),
    Bad("model_no_config", ("--hf-checkpoint=", "no config.json"), argv=lambda w: w.base + ["--hf-checkpoint", w.model_copy(lambda p: (p / "config.json").unlink())]),
    Bad("model_bad_config", ("--hf-checkpoint", "config.json is not valid JSON"), argv=lambda w: w.base + ["--hf-checkpoint", w.model_copy(lambda p: _truncate(p / "config.json"))]),
    Bad("model_no_tokenizer", ("--hf-checkpoint=", "no tokenizer"), argv=lambda w: w.base + ["--hf-checkpoint", w.model_copy(lambda p: [(p / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")])]),
    Bad("model_no_weights", ("--hf-checkpoint=", "no weights"), argv=lambda w: w.base + ["--hf-checkpoint", w.model_copy(lambda p: (p / "model.safetensors").unlink())]),
    Bad("model_truncated", ("--hf-checkpoint", "model.safetensors is truncated"), argv=lambda w: w.base + ["--hf-checkpoint", w.model_copy(lambda p: _truncate(p / "model.safetensors"))]),
    Bad("model_index_shard_missing", ("model-00002-of-00002.safetensors is named by model.safetensors.index.json",), argv=lambda w: w.base + ["--hf-checkpoint", w.model_copy(lambda p: (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}})))]),
    Bad("ref_load_missing", ("--ref-load=", "noref", "does not exist"), argv=lambda w: w.base + ["--ref-load", str(w.tmp / "noref")]),
    # ---- checkpoints: --load before anything starts -----------------------------------------------------
    Bad("load_typo", ("--load=", "does not exist", "did you mean", "ckpt"), argv=lambda w: w.base + ["--load", w.checkpoint() + "x"]),
    Bad("load_lost_tracker", ("--load=", "holds checkpoints (iter_0000000)", TRACKER_FILE), argv=lambda w: w.base + ["--load", w.checkpoint(lambda d: (d.parent / TRACKER_FILE).unlink())]),
    Bad("load_iter_dir", ("--load=", "is one checkpoint", "pass"), argv=lambda w: w.base + ["--load", w.checkpoint() + "/iter_0000000"]),
    Bad("load_bad_tracker", (TRACKER_FILE, "should hold a rollout id", "'seven'"), argv=lambda w: w.base + ["--load", w.checkpoint(lambda d: (d.parent / TRACKER_FILE).write_text("seven\n"))]),
    Bad("load_tracker_dangling", ("names rollout 7", "iter_0000007"), argv=lambda w: w.base + ["--load", w.checkpoint(lambda d: (d.parent / TRACKER_FILE).write_text("7\n"))]),
    # ---- checkpoints: the trainer's load and save -------------------------------------------------------
    Bad("dcp_shard_truncated", ("checkpoint shard", ".distcp is truncated"), call=lambda w: _load_linear(w.checkpoint(lambda d: _truncate(_first(d, "*.distcp"))))),
    Bad("dcp_shard_missing", ("checkpoint shard", ".distcp is missing"), call=lambda w: _load_linear(w.checkpoint(lambda d: _first(d, "*.distcp").unlink()))),
    Bad("dcp_metadata_truncated", ("checkpoint metadata", ".metadata cannot be read"), call=lambda w: _load_linear(w.checkpoint(lambda d: _truncate(d / ".metadata")))),
    Bad("meta_pt_truncated", ("iter_0000000/meta.pt cannot be read",), call=lambda w: _load_linear(w.checkpoint(lambda d: _truncate(d / "meta.pt")))),
    Bad("meta_pt_unsafe_pickle", ("meta.pt cannot be read", "Weights only load failed"), call=lambda w: _load_linear(w.checkpoint(lambda d: torch.save({"x": Path("/")}, d / "meta.pt")))),
    Bad("rng_truncated", ("rng/rank_00000.pt cannot be read",), call=lambda w: _load_linear(w.checkpoint(lambda d: _truncate(d / "rng" / "rank_00000.pt")))),
    Bad("checkpoint_of_another_model", ("cannot load checkpoint", "iter_0000000 into this model"), call=lambda w: _load_linear(w.checkpoint(), (3, 5))),
    Bad("save_disk_full", ("no space left on", "ckpt", "no .tmp left"), call=_full_disk_save),
    # ---- the trainer's model loading -------------------------------------------------------------------
    Bad("hf_load_missing_dir", ("--hf-checkpoint=", "does not exist"), call=lambda w: load_hf_model(str(w.tmp / "gone"))),
    Bad("hf_load_truncated", ("--hf-checkpoint", "model.safetensors is truncated"), call=lambda w: load_hf_model(w.model_copy(lambda p: _truncate(p / "model.safetensors")))),
    # ---- data read by the rollout side (whole file) ------------------------------------------------------
    Bad("dataset_line3_not_utf8", ("d.jsonl: line 3", "UTF-8"), call=lambda w: _dataset(w, w.write("d.jsonl", b'{"prompt": "a", "label": 1}\n\n{"prompt": "\xff", "label": 1}\n'))),
    Bad("dataset_line2_missing_label", ("e.jsonl: line 2", "missing key 'label'"), call=lambda w: _dataset(w, w.rows("e.jsonl", [{"prompt": "a", "label": 1}, {"prompt": "b"}]))),
    Bad("dataset_all_too_long", ("data.jsonl has no usable rows", "--rollout-max-prompt-len=1"), call=lambda w: _dataset(w, w.data, max_prompt_len=1)),
    Bad("no_prompt_fits", ("--prompt-data=", "prompts fit --rollout-max-prompt-len=1"), argv=lambda w: w.base + ["--rollout-max-prompt-len", "1"]),
    Bad("dataset_parquet_truncated", ("p.parquet", "cannot read as Parquet"), call=lambda w: _dataset(w, w.write("p.parquet", b"PAR1garbage"))),
    # ---- rewards ---------------------------------------------------------------------------------------
    Bad("reward_raises", ("reward function --custom-rm-path=", "failed on sample index 0", "ZeroDivisionError"), call=lambda w: _score(w, "def score(args, s):\n    return 1 / 0\n")),
    Bad("reward_nan", ("returned nan", "sample index 1"), call=lambda w: _score(w, "def score(args, s):\n    return float('nan') if s.index else 1.0\n")),
    Bad("reward_string", ("returned '1'", "expected a finite float"), call=lambda w: _score(w, "def score(args, s):\n    return s.response\n")),
    Bad("reward_async_raises", ("failed on sample index 1", "KeyError"), call=lambda w: _score(w, "async def score(args, s):\n    return {}['x'] if s.index else 0.0\n")),
    Bad("reward_hangs", ("reward function --custom-rm-path=catalog_rm_hangs:score", "no answer within 0.3s", "--reward-timeout", "sample index 4"), call=_hung_reward),
    # ---- engine HTTP (the embedded engine's SGLang contract) --------------------------------------------
    Bad("engine_prompt_beyond_context", ("/generate answered 400", "longer than the model's context length"), call=lambda w: _engine_post(w, "/generate", {"input_ids": [1] * _context_len(w), "sampling_params": {"max_new_tokens": 1}})),
    Bad("engine_max_new_tokens_beyond_context", ("/generate answered 400", "exceeds the model's maximum context length"), call=lambda w: _engine_post(w, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": _context_len(w)}})),
    Bad("engine_body_not_json", ("/generate answered 400",), call=lambda w: _engine_post(w, "/generate", b'{"input_ids": [1,')),
    Bad("engine_weights_do_not_decode", ("/update_weights_from_tensor answered 400", "serialized_named_tensors[0] does not decode"), call=lambda w: _engine_post(w, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%not base64"]}, before=("/begin_weight_update",), after=("/end_weight_update",))),
    Bad("engine_admin_unknown_field", ("/flush_cache answered 400", "unknown fields ['everything']"), call=lambda w: _engine_post(w, "/flush_cache", {"everything": True})),
]  # fmt: skip


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from transformers import AutoTokenizer

    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("catalog")
    model = str(build_tiny_model(root / "model", task="echo", seed=0))
    data = str(write_jsonl(make_rows("echo", 8, seed=0), root / "data.jsonl"))
    return model, data, AutoTokenizer.from_pretrained(model)


@pytest.fixture
def world(shared, tmp_path, monkeypatch):
    model, data, tokenizer = shared
    (tmp_path / "mods").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    before = set(sys.modules)
    yield World(tmp_path, model, data, tokenizer)
    for name in set(sys.modules) - before:
        if name.startswith(("cat_", "catalog_")):
            del sys.modules[name]


def test_catalog_is_large_and_names_are_unique():
    names = [b.name for b in CATALOG]
    assert len(names) >= 40 and len(set(names)) == len(names)
    assert all((b.argv is None) != (b.call is None) for b in CATALOG)


def test_valid_launch_line_passes_dry_run(world, capsys):
    from miles.train import main

    assert main(world.base) == 0, capsys.readouterr().err
    assert "hf_checkpoint" in capsys.readouterr().out and not world.run_dir.exists()


def test_load_of_the_hf_directory_starts_from_it(world, capsys, caplog):
    """The reference's `--load /root/Qwen3-4B` (a directory without a checkpoint, no --save) passes, saying once
    that the run starts from the --hf-checkpoint weights."""
    from miles.train import main

    with caplog.at_level("WARNING", logger="miles.preflight.checks"):
        assert main(world.base + ["--load", world.model]) == 0, capsys.readouterr().err
    (line,) = [r.getMessage() for r in caplog.records if "--load" in r.getMessage()]
    assert "holds no checkpoint" in line and "starts from the --hf-checkpoint weights" in line


@pytest.mark.parametrize("bad", CATALOG, ids=[b.name for b in CATALOG])
def test_bad_input_names_its_culprit(bad: Bad, world: World, capsys):
    from miles.train import main

    if bad.argv is not None:
        argv = bad.argv(world)
        capsys.readouterr()
        assert main(argv) == 2
        message = capsys.readouterr().err
        assert not world.run_dir.exists()
    else:
        with pytest.raises(Exception) as info:  # noqa: B017 - each entry names its own error text below
            bad.call(world)
        message = str(info.value)
    for fragment in bad.expect:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert "Repo id must be" not in message and "Traceback" not in message
    leftovers = [str(p) for p in world.tmp.rglob("*.tmp")]
    assert not leftovers, f"half-written files left behind: {leftovers}"


def test_bad_input_exits_before_ray_is_imported(world):
    """The CLI refuses a bad file with exit 2 in a fresh interpreter in which importing ray would fail."""
    code = "import sys; sys.modules['ray'] = None\nfrom miles.train import main\nsys.exit(main(sys.argv[1:]))"
    argv = [a for a in world.base if a != "--dry-run"] + ["--prompt-data", str(world.tmp / "missing.jsonl")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "--prompt-data" in proc.stderr and "missing.jsonl" in proc.stderr
    assert not world.run_dir.exists()
