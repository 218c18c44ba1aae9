"""Adapter-only LoRA refit (--lora-refit adapter): the engines serve the frozen base plus the adapter, unmerged,
and each refit ships only the adapter.

Protocol (SGLang 0.5.23, docs/sglang-contract.md):
- the first refit of a run pushes the base weights (the frozen model, unmerged, under the HF names) through the
  run's transport (`miles.refit.refitter.Refitter`): colocated engines released theirs before the trainers
  loaded. After it the engines keep their weights resident (the choreography releases only the KV cache), so
  later refits move no base weight;
- every refit: training rank 0 writes the adapter (all ranks gather it: small) as a PEFT directory,
  ``<run-dir>/lora_adapters/<name>/`` with ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A
  .weight`` ...) and ``adapter_config.json``, atomically (a temporary directory renamed into place), then posts
  ``/load_lora_adapter {lora_name, lora_path}`` to every engine under a new name per weight version
  (`adapter_name`), then ``/unload_lora_adapter`` of the previous name, then deletes the previous directory.
  SGLang loads by path, so the engines must see the run directory (one node, or a shared file system); SGLang
  also has ``/load_lora_adapter_from_tensors`` (pickled tensors, same-node handles), which miles does not use;
- engines restarted by fault tolerance load the base from --hf-checkpoint themselves (it is the frozen base) and
  get the current adapter only;
- the rollout side asks the engines which adapter is loaded (``GET /v1/models``, `newest_adapter`) before each
  rollout and sends it as every /generate request's ``lora_path``; an engine without it answers an error (never
  a silent base-model rollout).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from miles.utils.types import JSON

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from miles.refit.buckets import RefitSource
    from miles.refit.refitter import Refitter

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "miles-lora-v"
ADAPTER_DIR = "lora_adapters"  # under the run directory
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_name(weight_version: str) -> str:
    """The name an adapter is loaded under on the engines for `weight_version`."""
    return f"{ADAPTER_PREFIX}{weight_version}"


def newest_adapter(names: Sequence[str]) -> str | None:
    """The miles adapter of the highest weight version among `names` (what `GET /v1/models` lists); None: none."""
    ours = [n for n in names if n.startswith(ADAPTER_PREFIX) and n[len(ADAPTER_PREFIX) :].isdigit()]
    return max(ours, key=lambda n: int(n[len(ADAPTER_PREFIX) :]), default=None)


def adapter_names_in(models: JSON) -> list[str]:
    """The adapter names of a `GET /v1/models` answer (the cards with a `parent`)."""
    data = models.get("data") if isinstance(models, dict) else None
    cards = data if isinstance(data, list) else []
    return [str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent") and "id" in c]


def write_adapter(
    root: str, name: str, tensors: dict[str, torch.Tensor], config: Mapping[str, object]
) -> str:
    """Write a PEFT adapter directory `root/name` atomically; returns its absolute path."""
    from safetensors.torch import save_file

    final = os.path.abspath(os.path.join(root, name))
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(tmp, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of tensor data one adapter-only refit ships."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterRefitter:
    """The refit of one training rank under --lora-refit adapter (collective: every rank calls `update` with the
    same arguments and all raise together). Wraps the run's `Refitter`, used once for the base weights."""

    def __init__(self, refitter: Refitter, run_dir: str) -> None:
        self.refitter = refitter
        self.root = os.path.join(os.path.abspath(run_dir), ADAPTER_DIR)
        self.engines: list[str] | None = None  # every engine, known after the first update
        self.current: str | None = None  # the adapter every engine serves
        self.last_bytes = 0  # tensor bytes of the last update's adapter
        self._group: dist.ProcessGroup | None = None

    def update(
        self,
        base: RefitSource,
        adapters: Callable[[], dict[str, torch.Tensor]],
        config: Mapping[str, object],
        version: str,
        engine_urls: list[str],
        resume_tags: Sequence[str] = (),
    ) -> int:
        """Refit `engine_urls` (all engines, or restarted ones) with the adapter `adapters()` (collective: the
        gathered tensors under peft's names) as `version`; the base weights `base` go out at the first update
        only. Returns the adapter's bytes."""
        urls = [u.rstrip("/") for u in engine_urls]
        first = self.engines is None
        if first:  # the transport resumes `resume_tags` and pushes the frozen base
            self.refitter.update(base, version, urls, resume_tags)
            self.engines = urls
        elif resume_tags:
            self._agreed(lambda: self._resume(urls, list(resume_tags)))
        tensors = adapters()
        restarted = not first and urls != self.engines
        self._agreed(lambda: self._load(tensors, config, version, urls, restarted))
        self.last_bytes = adapter_bytes(tensors)
        return self.last_bytes

    def _resume(self, urls: list[str], tags: list[str]) -> None:
        from miles.utils.engine_control_http import EngineMemoryControl

        s = self.refitter.settings
        EngineMemoryControl(urls, s.api_key, s.resume_timeout_s).resume_memory(tags)

    def _load(
        self,
        tensors: dict[str, torch.Tensor],
        config: Mapping[str, object],
        version: str,
        urls: list[str],
        restarted: bool,
    ) -> None:
        """Rank 0: write the adapter, load it on `urls`, then unload (and delete) the previous one, unless these
        are restarted engines (they never had it)."""
        from miles.utils.engine_control_http import bearer, on_every_engine, post_engine

        s = self.refitter.settings
        headers, name = bearer(s.api_key), adapter_name(version)
        path = write_adapter(self.root, name, tensors, config)
        previous = None if restarted else self.current

        def post(endpoint: str, body: dict[str, JSON], what: str) -> None:
            on_every_engine(urls, lambda url: post_engine(url, endpoint, body, headers, s.timeout_s, what))

        if previous == name:  # the same version again (never in a run's order; a name loads once)
            post("/unload_lora_adapter", {"lora_name": name}, f"LoRA refit {version}: unload {name}")
            previous = None
        post(
            "/load_lora_adapter", {"lora_name": name, "lora_path": path}, f"LoRA refit {version}: load {name}"
        )
        if previous is not None:
            post("/unload_lora_adapter", {"lora_name": previous}, f"LoRA refit {version}: unload {previous}")
            shutil.rmtree(os.path.join(self.root, previous), ignore_errors=True)
        self.current = name
        logger.info(
            "LoRA refit %s: adapter %s (%d tensors) on %d engines", version, name, len(tensors), len(urls)
        )

    def _agreed(self, fn: Callable[[], object]) -> None:
        """Run `fn` on rank 0; every rank raises its error together (`raise_if_any_failed`)."""
        import torch.distributed as dist

        from miles.refit.session import raise_if_any_failed

        r = self.refitter
        error = None
        if r.rank == 0:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported to every rank, so none hangs
                error = f"rank 0: {type(exc).__name__}: {exc}"
        if r.world_size > 1 and self._group is None:
            self._group = dist.new_group(list(range(r.world_size)), backend="gloo")
        if r.world_size > 1:
            assert self._group is not None
            raise_if_any_failed(error, r.world_size, self._group)
        elif error is not None:
            raise RuntimeError("weight update failed: " + error)
