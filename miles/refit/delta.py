"""Delta refit for the broadcast path (--update-weight-delta): send only the tensors that changed since the last
version every target engine acknowledged.

Training rank 0 keeps, per engine, the fingerprint (BLAKE2b-128 of the bytes sent, with dtype and shape) of every
tensor of the version that engine last acknowledged (served it after the refit: `verify_refit`). A refit
fingerprints every gathered tensor and broadcasts it unless every target engine's acknowledged fingerprint of it
is the same; the bytes of unchanged tensors stay on the engines. No copy of the weights is kept, only 16 bytes per
tensor per engine.

An engine gets everything (a full refit) when:

- the mode is ``none`` (the default: hashing costs rank 0 a pass over the bytes per refit, and full fine-tuning
  changes nearly every tensor every step, so the delta would save nothing);
- it does not declare delta support: SGLang 0.5.23 has no delta protocol (whether an engine keeps the tensors a
  refit leaves out, bit for bit, after its post-load processing is not part of its contract), so only engines whose
  ``/get_server_info`` has the miles-only ``refit_delta_version`` field (the embedded engine) take part;
- it holds no acknowledged version here: new to this trainer, restarted (`DeltaTracker.forget`, fault tolerance),
  or a refit to it failed;
- the version it reports as intact (``refit_delta_version``: the version it serves with every tensor loaded
  since its last memory resume, else null) is not the one it acknowledged.

Tensors are broadcast to the whole update group, so one engine needing a tensor sends it to all (same bytes).
The checksums of ``check_equal`` cover every tensor, sent or not, so they prove the engine bit-equal.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from miles.utils.engine_control_http import get_engine_json

logger = logging.getLogger(__name__)

DELTA_MODES = ("none", "changed")
# miles-only field of /get_server_info: the version the engine serves with all its tensors intact (else null)
SERVER_INFO_FIELD = "refit_delta_version"


def fingerprint(t: torch.Tensor) -> bytes:
    """BLAKE2b-128 of ``t``'s dtype, shape and bytes (a CUDA tensor is copied to the host to hash)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    h.update(memoryview(data.numpy()))
    return h.digest()


def probe_bases(
    urls: list[str], headers: dict[str, str], timeout_s: float, version: str
) -> dict[str, str | None]:
    """Per engine, the version it declares intact for a delta (``refit_delta_version``); None when it has none
    or does not declare delta support (logged, naming the engine)."""
    bases: dict[str, str | None] = {}
    for url in urls:
        info = get_engine_json(url, "get_server_info", headers, timeout_s, f"delta probe of refit {version}")
        if SERVER_INFO_FIELD not in info:
            logger.info(
                "refit %s: engine %s gets a full refit: it does not declare delta refit support (no %r in "
                "/get_server_info; SGLang has no delta protocol)", version, url, SERVER_INFO_FIELD,
            )  # fmt: skip
            bases[url] = None
            continue
        base = info[SERVER_INFO_FIELD]
        bases[url] = None if base is None else str(base)
    return bases


@dataclass
class RefitStats:
    """What one refit moved: tensors and bytes sent, out of all the model's."""

    tensors_total: int = 0
    tensors_sent: int = 0
    bytes_total: int = 0
    bytes_sent: int = 0
    full_engines: int = 0  # engines that got every tensor

    def metrics(self) -> dict[str, float]:
        return {
            "perf/refit_bytes": float(self.bytes_sent),
            "perf/refit_bytes_full": float(self.bytes_total),
            "perf/refit_tensors_sent": float(self.tensors_sent),
            "perf/refit_tensors_total": float(self.tensors_total),
        }


class DeltaTracker:
    """Rank 0's record of what each engine acknowledged, and the choice of tensors to send (see the module
    docstring). Per refit: `begin` (the targets and the versions they declare intact), `select` for every bucket,
    then `acknowledge` after the refit was verified, or `forget` the targets when it failed."""

    def __init__(self, mode: str) -> None:
        if mode not in DELTA_MODES:
            raise ValueError(f"--update-weight-delta {mode!r}: allowed {list(DELTA_MODES)}")
        self.mode = mode
        self._acked: dict[str, tuple[str, dict[str, bytes]]] = {}  # url -> (version, name -> fingerprint)
        self._targets: list[str] = []
        self._bases: list[dict[str, bytes] | None] = []  # per target: acknowledged fingerprints, None: full
        self._current: dict[str, bytes] = {}  # this refit's fingerprints
        self.stats = RefitStats()

    def forget(self, urls: list[str]) -> None:
        """``urls`` hold no acknowledged version any more (restarted, or a refit to them failed)."""
        for url in urls:
            self._acked.pop(url, None)

    def begin(self, bases: dict[str, str | None], version: str) -> None:
        """A refit to the engines of ``bases`` (url -> the version it declares intact) as ``version``."""
        self._targets, self._current, self.stats = list(bases), {}, RefitStats()
        self._bases = []
        for url, intact in bases.items():
            acked = self._acked.get(url) if self.mode != "none" else None
            usable = acked is not None and intact is not None and acked[0] == intact
            if acked is not None and not usable:
                logger.info(
                    "refit %s: engine %s gets a full refit: it acknowledged version %s here but declares %s "
                    "intact", version, url, acked[0], intact,
                )  # fmt: skip
            self._bases.append(acked[1] if usable and acked is not None else None)
        self.stats.full_engines = sum(b is None for b in self._bases)

    def select(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors of ``bucket`` to send: those some target's acknowledged fingerprint does not match."""
        s = self.stats
        out = []
        for name, t in bucket:
            nbytes = t.numel() * t.element_size()
            s.tensors_total += 1
            s.bytes_total += nbytes
            if self.mode != "none":
                self._current[name] = fp = fingerprint(t)
                if all(base is not None and base.get(name) == fp for base in self._bases):
                    continue
            s.tensors_sent += 1
            s.bytes_sent += nbytes
            out.append((name, t))
        return out

    def acknowledge(self, version: str) -> None:
        """Every target now serves ``version``, verified: its fingerprints are the base of the next delta."""
        if self.mode == "none":
            return
        for url in self._targets:
            self._acked[url] = (version, self._current)
