"""`miles doctor`: check a run's setup before starting it, and print one table.

    python -m miles.tools.doctor [the run's flags, as given to python -m miles.train]

Rows (check, status, detail), status OK, WARN or BLOCKER: Python, torch and its CUDA build, the NVIDIA driver
and the visible GPUs; the installed versions of the packages miles' contract is tested with (sglang,
sglang-router, flash-attn, ring-flash-attn, transformers, ray) against the requirements in pyproject.toml (the
one place they are pinned; a mismatch is a warning); Ray's view of a running cluster (nodes, GPUs; none is
started: without RAY_ADDRESS or a local cluster the row says "no cluster"); the model directory (config,
tokenizer, weights, parameter count) and the training state per GPU for the layout (fp32 master weights and
gradients plus the optimizer's states, sharded over the training GPUs) against the free memory of the GPUs
seen here; the prompt file (first row parses with the keys, how many prompts fit `--rollout-max-prompt-len`,
tokenized as the run does it); the free disk under `--save` against a checkpoint's size; and the pre-flight
checks `python -m miles.train` runs (rewards, functions, --load, attention kernels). Exit status: 0 when no
row is a BLOCKER, 1 otherwise, 2 for flags that do not parse.

`doctor_rows(cfg, probes)` builds the rows from a parsed Config and `Probes` (what is asked of the machine:
versions, GPUs, Ray, disk, the tokenizer), so every row can be driven in tests without GPUs. `miles.train` runs
the cheap part, `prompt_fit_problem`, before Ray starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.config import Config, ConfigError
from miles.preflight import parse_config
from miles.preflight.checks import PreflightError, RowKeys, data_file_problems, run_preflight

logger = logging.getLogger(__name__)

OK, WARN, BLOCKER = "OK", "WARN", "BLOCKER"
PACKAGES = ("torch", "transformers", "ray", "sglang", "sglang-router", "flash-attn", "ring-flash-attn")
FIT_ROWS = (
    1000  # prompts tokenized to count how many fit --rollout-max-prompt-len (all when the file is smaller)
)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
_DTYPE_BYTES.update({"BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1})
_LOCAL_RAY = Path(
    "/tmp/ray/ray_current_cluster"
)  # written by a running local Ray head (ray.init(address="auto"))
_CONFIG_DTYPE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Row:
    check: str
    status: str  # OK | WARN | BLOCKER
    detail: str


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class RayView:
    address: str
    nodes: int  # alive
    gpus: float
    cpus: float


@dataclass
class Probes:
    """What the doctor asks of the machine; tests replace any of these."""

    python: Callable[[], str] = lambda: sys.version.split()[0]
    versions: Callable[[], dict[str, str | None]] = lambda: installed_versions(PACKAGES)
    requirements: Callable[[], dict[str, str]] = lambda: tested_requirements()
    torch_cuda: Callable[[], str | None] = lambda: _torch_cuda_build()
    gpus: Callable[[], tuple[str | None, list[Gpu]]] = lambda: (
        nvidia_smi()
    )  # (driver, GPUs); (None, []): none
    ray: Callable[[], RayView | str] = lambda: ray_view()  # a str says why there is no cluster
    disk_free: Callable[[str], int] = lambda path: shutil.disk_usage(path).free
    tokenizer: Callable[[str], Any] = lambda path: _load_tokenizer(path)


# --- probes of the real machine -------------------------------------------------------------------------------


def installed_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """The installed version of each distribution, None when it is not installed."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def tested_requirements() -> dict[str, str]:
    """{distribution: specifier} of miles' dependencies and its `gpu` extra: pyproject.toml of the source tree
    when miles runs from one, else the installed distribution's metadata (written from the same file)."""
    from packaging.requirements import Requirement

    lines: list[str] = []
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib

        project = tomllib.loads(pyproject.read_text())["project"]
        lines = project["dependencies"] + project["optional-dependencies"]["gpu"]
    except (ImportError, OSError, KeyError):  # Python 3.10 or an installed wheel
        try:
            lines = [r.split(";")[0] for r in importlib.metadata.requires("miles") or []]
        except importlib.metadata.PackageNotFoundError:
            pass
    reqs = {}
    for line in lines:
        req = Requirement(line)
        reqs[req.name.lower()] = str(req.specifier)
    return reqs


def _torch_cuda_build() -> str | None:
    import torch

    return torch.version.cuda


def nvidia_smi() -> tuple[str | None, list[Gpu]]:
    """(driver version, visible GPUs with their memory) from nvidia-smi; (None, []) without a driver."""
    if shutil.which("nvidia-smi") is None:
        return None, []
    query = "--query-gpu=driver_version,name,memory.total,memory.free"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    keep = None if visible is None else {v.strip() for v in visible.split(",") if v.strip()}
    driver, gpus = None, []
    for i, line in enumerate(out.strip().splitlines()):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or (keep is not None and str(i) not in keep):
            continue
        driver = parts[0]
        gpus.append(Gpu(parts[1], int(float(parts[2])) * 2**20, int(float(parts[3])) * 2**20))
    return driver, gpus


def ray_view() -> RayView | str:
    """Connect to a running cluster (RAY_ADDRESS, else a local one) to read its nodes and GPUs; never start
    one. A str says why there is no view."""
    if importlib.util.find_spec("ray") is None:
        return "no cluster (ray is not installed)"
    address = os.environ.get("RAY_ADDRESS")
    if not address and not _LOCAL_RAY.exists():
        return "no cluster (RAY_ADDRESS is not set and no local Ray runs; the run starts its own)"
    import ray

    try:
        ray.init(address=address or "auto", logging_level=logging.ERROR, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - any failure to connect means: no cluster to look at
        return f"no cluster ({address or 'local'}: {type(e).__name__}: {e})"
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        res = ray.cluster_resources()
        return RayView(address or "local", len(alive), float(res.get("GPU", 0)), float(res.get("CPU", 0)))
    finally:
        ray.shutdown()  # disconnects; the cluster keeps running


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# --- the prompt-length count (also run by miles.train before Ray starts) ------------------------------------


@dataclass(frozen=True)
class PromptFit:
    checked: int  # prompts tokenized
    fit: int  # of those, prompts of at most max_prompt_len tokens
    whole_file: bool  # whether `checked` is every prompt of the file
    shortest: int  # tokens of the shortest prompt checked


def count_prompts_that_fit(
    path: str, keys: RowKeys, tokenizer: Any, max_prompt_len: int, limit: int
) -> PromptFit:
    """Tokenize the first `limit` prompts of `path` as the run's dataset does (chat template included) and count
    those of at most `max_prompt_len` tokens. ValueError (naming the row) for a row that does not parse."""
    from miles.rollout.data_source import PromptDataset, iter_rows

    checked = fit = 0
    shortest = sys.maxsize
    rows = iter_rows(path)
    for where, row in rows:
        if checked == limit:
            return PromptFit(checked, fit, False, shortest)
        record = PromptDataset._make_record(where, row, tokenizer=tokenizer, **keys)
        n = len(record.prompt_ids)
        checked += 1
        fit += n <= max_prompt_len
        shortest = min(shortest, n)
    return PromptFit(checked, fit, True, shortest)


def _fit_text(fit: PromptFit, max_prompt_len: int) -> str:
    of = f"all {fit.checked}" if fit.whole_file else f"the first {fit.checked}"
    return f"{fit.fit} of {of} prompts fit --rollout-max-prompt-len={max_prompt_len} (shortest: {fit.shortest} tokens)"


def prompt_fit_problem(cfg: Config, tokenizer: Any = None, limit: int = FIT_ROWS) -> str | None:
    """The blocker a run would meet only after Ray and the engines started: no prompt of `--prompt-data` fits
    `--rollout-max-prompt-len`. Counted on the first `limit` rows (all when the file is smaller); when none of
    those fit but the file goes on, a warning is logged instead. None when the flag is unset or prompts fit."""
    max_len = cfg.rollout.rollout_max_prompt_len
    if max_len is None or cfg.data.prompt_data is None or cfg.model.hf_checkpoint is None:
        return None
    try:
        tok = tokenizer if tokenizer is not None else _load_tokenizer(cfg.model.hf_checkpoint)
        fit = count_prompts_that_fit(cfg.data.prompt_data, _row_keys(cfg), tok, max_len, limit)
    except (OSError, ValueError) as e:  # a later row that does not parse, a tokenizer that does not load
        return f"--prompt-data={cfg.data.prompt_data!r}: {e}"
    if fit.fit:
        return None
    text = f"--prompt-data={cfg.data.prompt_data!r}: {_fit_text(fit, max_len)}"
    if fit.whole_file:
        return f"{text}: raise --rollout-max-prompt-len or shorten the prompts"
    logger.warning("%s; the rest of the file was not read", text)
    return None


def _row_keys(cfg: Config) -> RowKeys:
    d = cfg.data
    return RowKeys(
        input_key=d.input_key,
        label_key=d.label_key,
        metadata_key=d.metadata_key,
        apply_chat_template=d.apply_chat_template,
    )


# --- the rows --------------------------------------------------------------------------------------------------


def doctor_rows(cfg: Config, probes: Probes) -> list[Row]:
    """Every row of the table for `cfg`, asking the machine only through `probes`."""
    driver, gpus = probes.gpus()
    rows = [Row("python", OK, probes.python())]
    rows += _package_rows(probes.versions(), probes.requirements(), probes.torch_cuda, bool(gpus))
    rows.append(_gpu_row(driver, gpus))
    rows.append(_ray_row(cfg, probes.ray()))
    model = _model_rows(cfg)
    rows += model.rows
    if model.params is not None:
        rows.append(_memory_row(cfg, model.params, gpus))
    rows += _data_rows(cfg, probes)
    rows.append(_disk_row(cfg, model.params, probes.disk_free))
    rows.append(_preflight_row(cfg))
    return rows


def _package_rows(
    versions: dict[str, str | None], reqs: dict[str, str], torch_cuda: Callable[[], str | None], gpus: bool
) -> list[Row]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    gpu_extra = {"sglang", "flash-attn", "ring-flash-attn"}
    rows = []
    for name, version in versions.items():
        spec = reqs.get(name)
        wanted = f"pyproject: {spec or 'unpinned'}" if spec is not None else "not in pyproject"
        if version is None:
            if name in gpu_extra:
                why = "GPUs are visible: pip install 'miles[gpu]'" if gpus else "needed by GPU runs only"
                rows.append(Row(name, WARN if gpus else OK, f"not installed ({why})"))
            else:
                rows.append(Row(name, BLOCKER, f"not installed ({wanted}): pip install -e ."))
            continue
        detail = f"{version} ({wanted})"
        if name == "torch":
            detail += f", CUDA build {torch_cuda() or 'none (CPU)'}"
        try:
            fits = not spec or Version(version) in SpecifierSet(spec)
        except (InvalidVersion, InvalidSpecifier):
            fits = False
        rows.append(Row(name, OK if fits else WARN, detail + ("" if fits else ": not the tested version")))
    return rows


def _gpu_row(driver: str | None, gpus: list[Gpu]) -> Row:
    if not gpus:
        return Row("GPUs", OK, "none visible (no NVIDIA driver or CUDA_VISIBLE_DEVICES empty): a CPU run")
    names = sorted({g.name for g in gpus})
    free = min(g.free_bytes for g in gpus)
    return Row("GPUs", OK, f"driver {driver}, {len(gpus)} x {', '.join(names)}, least free {_size(free)}")


def _ray_row(cfg: Config, view: RayView | str) -> Row:
    if isinstance(view, str):
        return Row("ray cluster", OK, view)
    c = cfg.cluster
    train = c.actor_num_nodes * c.actor_num_gpus_per_node
    need = train if c.colocate else train + (c.rollout_num_gpus or 0)
    detail = (
        f"{view.address}: {view.nodes} nodes, {view.gpus:g} GPUs, {view.cpus:g} CPUs; the layout needs {need}"
    )
    if view.gpus and view.gpus < need:
        return Row("ray cluster", BLOCKER, f"{detail} GPUs: more than the cluster has")
    return Row("ray cluster", OK, detail + (" GPUs" if view.gpus else " CPU workers"))


@dataclass
class _Model:
    rows: list[Row]
    params: int | None  # parameter count, None when unknown


def _model_rows(cfg: Config) -> _Model:
    from miles.utils.hf_files import hf_dir_problems

    path = cfg.model.hf_checkpoint
    problems = hf_dir_problems(path, "--hf-checkpoint", need_tokenizer=True)
    if problems or path is None:
        return _Model([Row("model", BLOCKER, "\n".join(problems))], None)
    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    params, exact = parameter_count(root, _CONFIG_DTYPE.get(str(config.get("torch_dtype")), 2))
    about = "" if exact else "about "
    detail = f"{path}: {config.get('model_type', '?')}, {about}{_count(params)} parameters, tokenizer present"
    return _Model([Row("model", OK, detail)], params)


def parameter_count(root: Path, bytes_per_param: int) -> tuple[int, bool]:
    """(parameters, exact): summed from the safetensors headers, else estimated from the weight files' sizes."""
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        size = sum(p.stat().st_size for p in root.glob("pytorch_model*.bin"))
        return size // bytes_per_param, False
    total = 0
    for shard in shards:
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                numel = 1
                for dim in info["shape"]:
                    numel *= dim
                total += numel
    return total, True


def _training_gpus(cfg: Config) -> int:
    return cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node


def train_state_bytes(cfg: Config, params: int) -> int:
    """Bytes of training state per training rank: fp32 master weights, fp32 gradients and the optimizer's fp32
    states (Adam: 2, SGD: none), FSDP-sharded over the training ranks. With LoRA the base weights are frozen
    (fp32, no gradient or optimizer state; the adapter is not counted). Activations are not counted."""
    per_param = 4 if cfg.lora.lora_rank else 8 + (8 if cfg.optim.optimizer == "adam" else 0)
    return params * per_param // _training_gpus(cfg)


def checkpoint_bytes(cfg: Config, params: int) -> int:
    """Bytes of one `--save` checkpoint: fp32 weights and optimizer states (LoRA: the adapter only, small), plus
    a bf16 HuggingFace copy with `--save-hf`."""
    per_param = 0 if cfg.lora.lora_rank else 4 + (8 if cfg.optim.optimizer == "adam" else 0)
    return params * per_param + (params * 2 if cfg.checkpoint.save_hf else 0)


def _memory_row(cfg: Config, params: int, gpus: list[Gpu]) -> Row:
    need = train_state_bytes(cfg, params)
    n = _training_gpus(cfg)
    what = f"training state {_size(need)} per training rank ({_count(params)} params over {n} ranks)"
    if cfg.train.fsdp_cpu_offload:
        return Row("memory", OK, f"{what}, on the CPU (--fsdp-cpu-offload)")
    if not gpus:
        return Row("memory", OK, f"{what}; no GPU visible here to compare with")
    free = min(g.free_bytes for g in gpus)
    if need > free:
        return Row("memory", BLOCKER, f"{what} > {_size(free)} free on a GPU: add GPUs or --fsdp-cpu-offload")
    status = WARN if need > 0.8 * free else OK
    return Row("memory", status, f"{what}, {_size(free)} free on the fullest GPU (activations need the rest)")


def _data_rows(cfg: Config, probes: Probes) -> list[Row]:
    keys = _row_keys(cfg)
    path = cfg.data.prompt_data
    if path is None:
        return [Row("prompt data", BLOCKER, "--prompt-data is not set")]
    problems = data_file_problems("--prompt-data", path, keys)
    if problems:
        return [Row("prompt data", BLOCKER, "\n".join(problems))]
    max_len = cfg.rollout.rollout_max_prompt_len
    if max_len is None or cfg.model.hf_checkpoint is None or not Path(cfg.model.hf_checkpoint).is_dir():
        return [
            Row("prompt data", OK, f"{path}: first row parses (--rollout-max-prompt-len unset: not counted)")
        ]
    try:
        fit = count_prompts_that_fit(path, keys, probes.tokenizer(cfg.model.hf_checkpoint), max_len, FIT_ROWS)
    except ValueError as e:
        return [Row("prompt data", BLOCKER, f"--prompt-data: {e}")]
    text = f"{path}: {_fit_text(fit, max_len)}"
    if fit.fit == 0:
        return [Row("prompt data", BLOCKER if fit.whole_file else WARN, text)]
    return [Row("prompt data", OK, text)]


def _disk_row(cfg: Config, params: int | None, disk_free: Callable[[str], int]) -> Row:
    save = cfg.checkpoint.save
    if save is None:
        return Row("disk", OK, "no --save: nothing written but logs")
    existing = Path(save).absolute()
    while not existing.exists():
        existing = existing.parent
    free = disk_free(str(existing))
    if params is None:
        return Row("disk", OK, f"{_size(free)} free under {existing} (checkpoint size unknown)")
    need = checkpoint_bytes(cfg, params)
    detail = f"a checkpoint is about {_size(need)}, {_size(free)} free under {existing}"
    if need > free:
        return Row("disk", BLOCKER, f"{detail}: --save needs more room")
    # a re-save keeps the previous checkpoint until the new one is complete: two must fit
    return Row("disk", WARN if 2 * need > free else OK, detail)


def _preflight_row(cfg: Config) -> Row:
    """What `python -m miles.train`'s pre-flight finds beyond the model and prompt rows above."""
    try:
        run_preflight(cfg)
    except PreflightError as e:
        left = [v for v in e.violations if not v.startswith(("--hf-checkpoint", "--prompt-data"))]
        if left:
            return Row("pre-flight", BLOCKER, "\n".join(left))
    return Row("pre-flight", OK, "rewards, functions, --load, --ref-load, attention kernels")


# --- the table and the command --------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table; a detail of several lines continues under its column."""
    w = max(len("check"), *(len(r.check) for r in rows))
    s = max(len("status"), *(len(r.status) for r in rows))
    lines = [f"{'check':<{w}}  {'status':<{s}}  detail"]
    for r in rows:
        first, *rest = r.detail.splitlines() or [""]
        lines.append(f"{r.check:<{w}}  {r.status:<{s}}  {first}")
        lines += [f"{'':<{w}}  {'':<{s}}  {more}" for more in rest]
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status == BLOCKER for r in rows) else 0


def main(
    argv: list[str] | None = None, probes: Probes | None = None, prog: str = "python -m miles.tools.doctor"
) -> int:
    """Print the table for the run flags `argv`; 0 without blockers, 1 with, 2 when the flags do not parse."""
    try:
        cfg = parse_config(argv, prog=prog)
    except ConfigError as e:
        print(f"{prog}: invalid configuration\n{e}", file=sys.stderr)
        return 2
    rows = doctor_rows(cfg, probes or Probes())
    print(format_table(rows))
    blockers = sum(r.status == BLOCKER for r in rows)
    warnings = sum(r.status == WARN for r in rows)
    print(f"\n{blockers} blocker(s), {warnings} warning(s)")
    return exit_code(rows)


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
