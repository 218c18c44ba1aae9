"""Pre-flight: every check of a parsed Config that needs the filesystem or an import, run by the driver after
`parse_config` and before Ray starts (and by `--dry-run`), so a bad path fails in a second, not after minutes.

    run_preflight(cfg)      # raises PreflightError listing every problem, one per line, each naming its flag

Checked: no unbuilt flag is set; a reward is configured, `--rm-type` is registered and every `--custom-*-path`
imports; the rollout seams (generate, filter, rollout, eval functions, tool) import and have their signatures; the prompt and eval files exist and their first rows parse with `--input-key` / `--label-key`; the
model directories hold a config, weights (safetensors complete) and, for the policy, a tokenizer; `--load`
is a checkpoint root, or a directory without one (the run starts from `--hf-checkpoint` and says so), or
`--save` not created yet; the
modules the `--attn-implementation` kernel needs are installed.

This module imports no torch, ray or transformers; user modules named by `--custom-*-path` are imported.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from miles.config.core import Config, ConfigError

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # = miles.backends.fsdp_utils.checkpoint.TRACKER_FILE
_CHECKPOINT_NAME = re.compile(r"^iter_\d{7}(\.old)?$")  # what --save writes (checkpoint.checkpoint_dir)
CUSTOM_FUNCTION_FLAGS = (
    ("rollout", "custom_rm_path"),
    ("algo", "custom_advantage_function_path"),
    ("algo", "custom_tis_function_path"),
    ("algo", "custom_loss_function_path"),
)


class RowKeys(TypedDict):
    """How a prompt file's rows are read (`check_first_row`'s keyword arguments)."""

    input_key: str
    label_key: str | None
    metadata_key: str | None
    apply_chat_template: bool


class PreflightError(ConfigError):
    """Every problem the pre-flight checks found, one per line."""

    def __init__(self, violations: list[str]) -> None:
        super().__init__(violations, title="pre-flight check failed")


def unbuilt_flags(cfg: Config) -> list[str]:
    """A problem per flag listed in NOT_IMPLEMENTED that is set to a non-default value."""
    return [
        f"{flag}: accepted but not implemented yet (listed in NOT_IMPLEMENTED, miles/config/fields.py); "
        "remove it"
        for flag in cfg.unimplemented_flags()
    ]


def reward_problems(
    rm_type: str | None, custom_rm_path: str | None, rm_url: str | None = None, agent: str | None = None
) -> list[str]:
    """A reward must be configured (`--rm-url` alone means the remote type) unless an agent
    (`--agent-function-path`) returns rewards, and a `--rm-type` must be registered (a `boxed_` prefix is
    allowed)."""
    if not rm_type and not custom_rm_path and not rm_url and not agent:
        return [
            "no reward function: set --rm-type (a built-in type), --custom-rm-path (module:function) or --rm-url"
        ]
    if custom_rm_path or not rm_type:
        return []
    from miles.rollout.rm_hub import get_reward_fn, reward_types

    try:
        get_reward_fn(rm_type)
    except ValueError:
        hint = difflib.get_close_matches(rm_type.removeprefix("boxed_"), reward_types(), n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        return [f"--rm-type={rm_type!r}: unknown reward type{extra}; registered: {reward_types()}"]
    return []


def rollout_function_problems(cfg: Config) -> list[str]:
    """Every rollout seam and reward function the flags name imports and has the expected signature."""
    from miles.rollout.runner import build_scorer
    from miles.rollout.seams import load_seams

    problems = []
    for check in (lambda: load_seams(cfg.rollout, cfg.eval), lambda: build_scorer(cfg.rollout)):
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    return problems


def function_path_problems(paths: dict[str, str | None]) -> list[str]:
    """Import every `{flag: 'module:function'}` that is set; a problem names the flag, the path and the cause."""
    from miles.utils.misc import load_function

    problems = []
    for flag, path in paths.items():
        if path:
            try:
                load_function(path, flag)
            except ValueError as e:
                problems.append(str(e))
    return problems


def data_file_problems(flag: str, path: str, keys: RowKeys) -> list[str]:
    """The prompt file given by `flag` exists and its first row parses with the configured keys."""
    from miles.rollout.data_source import check_first_row

    try:
        check_first_row(path, **keys)
    except ValueError as e:
        return [f"{flag}: {e}"]
    return []


def load_dir_problems(load: str | None, save: str | None, hf_checkpoint: str | None = None) -> list[str]:
    """`--load` is a checkpoint root written by `--save`, or an existing directory without a checkpoint (the
    reference passes the HF model directory itself), or `--save` not created yet: in the last two cases the
    run starts from the `--hf-checkpoint` weights, and one log line says so.

    Refused: a file; a path that does not exist and is not `--save` (a typo would silently start over); one
    `iter_N` of a checkpoint root instead of the root; a directory holding `iter_N` checkpoints but no tracker.
    """
    if not load:
        return []
    root = Path(load)
    tracker = root / TRACKER_FILE
    if root.is_dir() and tracker.is_file():
        return _tracker_problems(root, tracker)
    if root.exists() and not root.is_dir():
        return [f"--load={load!r}: is a file, not a checkpoint directory"]
    start = f"the run starts from the --hf-checkpoint weights ({hf_checkpoint!r})"
    if not root.exists():
        if hf_checkpoint is not None and os.path.abspath(load) == os.path.abspath(hf_checkpoint):
            return []  # the --hf-checkpoint check names the missing directory
        if save is not None and os.path.abspath(load) == os.path.abspath(save):
            logger.warning("--load=%r does not exist yet; it is also --save: %s", load, start)
            return []
        hint = ""
        if root.parent.is_dir():
            close = difflib.get_close_matches(root.name, [p.name for p in root.parent.iterdir()], n=1)
            hint = f" (did you mean {str(root.parent / close[0])!r}?)" if close else ""
        return [
            f"--load={load!r}: directory does not exist{hint}; to start from --hf-checkpoint, drop --load, set "
            "it to --save, or point it at an existing directory"
        ]
    if root.name.startswith("iter_") and (root.parent / TRACKER_FILE).is_file():
        return [f"--load={load!r}: is one checkpoint, not the root --save wrote: pass {str(root.parent)!r}"]
    saved = sorted(p.name for p in root.iterdir() if _CHECKPOINT_NAME.match(p.name) and p.is_dir())
    if saved:
        shown = ", ".join(saved[-3:])
        return [
            f"--load={load!r}: holds checkpoints ({shown}) but no {TRACKER_FILE}: write the rollout id to "
            "resume from into it (e.g. the N of the newest complete iter_N), or point --load elsewhere"
        ]
    logger.warning("--load=%r holds no checkpoint (no %s): %s", load, TRACKER_FILE, start)
    return []


def _tracker_problems(root: Path, tracker: Path) -> list[str]:
    text = tracker.read_text(errors="replace").strip()
    if not text.isdigit():
        return [f"--load: {tracker} should hold a rollout id, found {text[:40]!r}"]
    name = f"iter_{int(text):07d}"
    for candidate in (root / name, root / f"{name}.old"):  # .old: a re-save that crashed between renames
        if (candidate / "meta.pt").is_file() and (candidate / ".metadata").is_file():
            return []
    return [f"--load: {tracker} names rollout {int(text)}, but {root / name} is missing or incomplete"]


_FA2 = ("flash_attn", "FlashAttention-2 (package flash-attn): pip install 'miles[gpu]'")
_FA3 = (
    "flash_attn_interface",
    "FlashAttention-3, not on PyPI: build it from flash-attention's hopper/ directory "
    "(cd hopper && pip install --no-build-isolation .)",
)
_RING = (
    "ring_flash_attn",
    "ring-flash-attn: pip install 'miles[gpu]' (or pip install --no-deps ring-flash-attn)",
)


def attention_kernel_problems(attn_implementation: str, context_parallel_size: int) -> list[str]:
    """The modules the --attn-implementation kernel needs, where the driver runs (found, not imported; the
    trainers import them again at model build): flash_attention_2 -> flash_attn, and ring_flash_attn with
    --context-parallel-size > 1; flash_attention_3 -> flash_attn_interface."""
    needed = {"flash_attention_2": [_FA2], "flash_attention_3": [_FA3]}.get(attn_implementation, [])
    if attn_implementation == "flash_attention_2" and context_parallel_size > 1:
        needed.append(_RING)
    return [
        f"--attn-implementation {attn_implementation}"
        + (f" with --context-parallel-size {context_parallel_size}" if module == _RING[0] else "")
        + f" needs the module {module}, which is not installed: install {how}"
        for module, how in needed
        if importlib.util.find_spec(module) is None
    ]


def run_preflight(cfg: Config) -> None:
    """Run every check on `cfg`; raise PreflightError listing all problems found."""
    d, m, c = cfg.data, cfg.model, cfg.checkpoint
    checks: list[Callable[[], list[str]]] = [
        lambda: unbuilt_flags(cfg),
        lambda: reward_problems(
            cfg.rollout.rm_type,
            cfg.rollout.custom_rm_path,
            cfg.rollout.rm_url,
            cfg.rollout.agent_function_path if cfg.rollout.use_session_server else None,
        ),
        lambda: function_path_problems(
            {
                f"--{name.replace('_', '-')}": getattr(getattr(cfg, sec), name)
                for sec, name in CUSTOM_FUNCTION_FLAGS
            }
        ),
        lambda: _hf_problems(m.hf_checkpoint, "--hf-checkpoint", need_tokenizer=True),
        lambda: _ref_load_problems(c.ref_load) if c.ref_load else [],
        lambda: load_dir_problems(c.load, c.save, m.hf_checkpoint),
        lambda: _debug_data_problems(
            cfg.debug.load_debug_rollout_data, cfg.rollout.num_rollout, resuming=_has_checkpoint(c.load)
        ),
        lambda: attention_kernel_problems(m.attn_implementation, cfg.train.context_parallel_size),
    ]
    keys = RowKeys(
        input_key=d.input_key,
        label_key=d.label_key,
        metadata_key=d.metadata_key,
        apply_chat_template=d.apply_chat_template,
    )
    checks.append(lambda: data_file_problems("--prompt-data", d.prompt_data, keys))
    ev = cfg.eval
    eval_keys: RowKeys = {**keys, "input_key": ev.eval_input_key, "label_key": ev.eval_label_key}
    for name, path in ev.eval_datasets:
        checks.append(functools.partial(data_file_problems, f"--eval-prompt-data {name}", path, eval_keys))
    problems = [problem for check in checks for problem in check()]
    if not problems:  # imports user modules: only once the cheaper checks pass
        problems = rollout_function_problems(cfg)
    if problems:
        raise PreflightError(problems)


def _has_checkpoint(load: str | None) -> bool:
    """Whether `--load` names a checkpoint to resume from (a tracker file), not a directory to start fresh from."""
    if not load:
        return False
    return (Path(load) / TRACKER_FILE).is_file()


def _debug_data_problems(path: str | None, num_rollout: int, resuming: bool) -> list[str]:
    """--load-debug-rollout-data holds a file for every rollout the run trains on (the last one when resuming)."""
    if path is None:
        return []
    from miles.utils.debug_data import missing_rollouts

    ids = range(num_rollout - 1, num_rollout) if resuming else range(num_rollout)
    missing = missing_rollouts(path, ids)
    if not missing:
        return []
    shown = ", ".join(str(p) for p in missing[:3]) + (" ..." if len(missing) > 3 else "")
    return [
        f"--load-debug-rollout-data={path!r}: {len(missing)} of the {len(ids)} rollouts are missing: {shown}"
    ]


def _ref_load_problems(path: str) -> list[str]:
    """--ref-load is a HF directory, or a DCP checkpoint: one iter_N (.metadata) or a --save dir (tracker)."""
    p = Path(path)
    if (p / ".metadata").is_file() or (p / TRACKER_FILE).is_file():
        return []
    return _hf_problems(path, "--ref-load", need_tokenizer=False)


def _hf_problems(path: str | None, flag: str, need_tokenizer: bool) -> list[str]:
    from miles.utils.hf_files import hf_dir_problems

    return hf_dir_problems(path, flag, need_tokenizer)
