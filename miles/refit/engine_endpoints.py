"""The trainer's side of the refit endpoints: its HTTP calls to rollout engines around a refit (session,
verification, the weight-window probe). The engine's side of the same endpoints: `miles.engines.local.control`
(embedded) or SGLang's HTTP server. Generation is the rollout's (`miles.rollout.generate_client`); engine
memory control and health are `miles.utils.engine_control_http`'s.

Calls go through `miles.utils.engine_control_http`, so every failure names the engine, the endpoint, what it
was doing and the phase. The rules are SGLang 0.5.23's (docs/sglang-contract.md): a refit runs inside
``/begin_weight_update`` ... ``/end_weight_update``; the weight version an engine serves is the
``weight_version`` of ``/model_info``; ``/weights_checker`` with action ``checksum`` answers per-tensor checksums
(`miles.utils.weight_checksum`), one entry per TP rank (`miles.refit.checksums`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from miles.refit.checksums import RefitChecksums
from miles.utils.engine_control_http import EngineStatusError, get_engine_json, post_engine, request
from miles.utils.weight_checksum import device_hash_kind

LAYOUT_ENDPOINT = "weight_window_layout"  # miles-only: the embedded engine's weight-window layout


def begin_sessions(urls: list[str], headers: dict[str, str], timeout_s: float, version: str) -> list[str]:
    """Open a weight-update session on every engine. On a refusal, closes the sessions already opened and
    raises; returns the URLs (all of them) on success."""
    opened: list[str] = []
    try:
        for url in urls:
            post_engine(url, "begin_weight_update", {}, headers, timeout_s, f"refit {version}")
            opened.append(url)
    except Exception:
        end_sessions(opened, headers, timeout_s, version, raise_errors=False)
        raise
    return opened


def end_sessions(
    urls: Iterable[str], headers: dict[str, str], timeout_s: float, version: str, raise_errors: bool = True
) -> list[str]:
    """Close the session on every engine in ``urls`` (all are tried); returns the errors, raising the first
    when ``raise_errors``."""
    errors = []
    for url in urls:
        try:
            post_engine(url, "end_weight_update", {}, headers, timeout_s, f"refit {version}")
        except Exception as exc:  # noqa: BLE001 - every engine gets its end; the errors are reported together
            errors.append(str(exc))
    if errors and raise_errors:
        raise RuntimeError(" | ".join(errors))
    return errors


def verify_versions(urls: list[str], version: str, headers: dict[str, str], timeout_s: float) -> None:
    """Every engine must serve ``version`` (``weight_version`` of ``/model_info``)."""
    wrong = []
    for url in urls:
        got = get_engine_json(url, "model_info", headers, timeout_s, f"weight check after refit {version}")
        if str(got.get("weight_version")) != version:
            wrong.append(f"{url} reports {got.get('weight_version')!r}")
    if wrong:
        raise RuntimeError(f"after refit to weight version {version!r}: " + "; ".join(wrong))


def engine_checksums(
    url: str, headers: dict[str, str], timeout_s: float, version: str
) -> list[dict[str, str]]:
    """The per-tensor checksums each TP rank of an engine reports (``/weights_checker``, action checksum), by TP
    rank. SGLang answers one entry per scheduler (GPU), its ``parallelism_info`` a list with one item per model
    role it serves; the ``target`` item's ``tp_rank`` places it (a draft model's names carry its role as a
    prefix, so they never match the trainer's)."""
    answer = post_engine(
        url, "weights_checker", {"action": "checksum"}, headers, timeout_s, f"checksums after refit {version}"
    )
    return checksums_by_rank(url, answer)


def checksums_by_rank(url: str, answer: dict) -> list[dict[str, str]]:
    """The per-tensor checksums by TP rank in a ``/weights_checker`` answer (`engine_checksums`), or in the
    embedded engine's ``/update_weights_from_window`` answer asked with ``checksums``."""
    ranks = answer.get("ranks") or []
    if not isinstance(ranks, list) or not ranks:
        raise RuntimeError(f"engine {url}, weights_checker: no per-rank checksums in {answer}")
    by_rank: dict[int, dict[str, str]] = {}
    for entry in ranks:
        if not isinstance(entry, dict) or not isinstance(sums := entry.get("checksums"), dict):
            raise RuntimeError(
                f"engine {url}, weights_checker: a rank reports no 'checksums' object in {answer}"
            )
        infos = entry.get("parallelism_info") or []
        target = [
            i
            for i in (infos if isinstance(infos, list) else [infos])
            if isinstance(i, dict) and i.get("role", "target") == "target"
        ]
        if target:
            by_rank[int(str(target[0].get("tp_rank", 0)))] = {n: str(v) for n, v in sums.items()}
    if sorted(by_rank) != list(range(len(by_rank))):
        raise RuntimeError(f"engine {url}, weights_checker: TP ranks {sorted(by_rank)} are not 0..n-1")
    return [by_rank[r] for r in range(len(by_rank))]


def compare_checksums(
    url: str, trainer: list[dict[str, set[str]]], engine: list[dict[str, str]], version: str
) -> int:
    """Raise naming the engine, the weight version and every tensor (with its TP rank) whose checksum differs
    from the trainer's; returns the number compared. ``trainer[r]``: what TP rank ``r`` may report per name
    (`miles.refit.checksums.RefitChecksums.expected`). Names on one side only are not comparable (SGLang fuses
    q/k/v and gate/up, the trainer skips layouts it does not know); at least one must be."""
    if len(engine) != len(trainer):
        raise RuntimeError(
            f"engine {url}: after refit {version}, it reports {len(engine)} TP ranks, the trainer expects "
            f"{len(trainer)} (--rollout-num-gpus-per-engine)"
        )
    compared, differ = 0, []
    for rank, (want, got) in enumerate(zip(trainer, engine, strict=True)):
        for name in sorted(set(want) & set(got)):
            compared += 1
            if got[name] not in want[name]:
                differ.append(name if len(trainer) == 1 else f"{name} (TP rank {rank})")
    if not compared:
        raise RuntimeError(
            f"engine {url}: no tensor name in common with the trainer to compare checksums after refit "
            f"{version} (engine names e.g. {sorted(engine[0])[:4]})"
        )
    if differ:
        raise RuntimeError(
            f"engine {url}: after refit to weight version {version}, {len(differ)} of {compared} tensors differ "
            f"from the trainer's (checksum): {', '.join(differ[:5])}" + (" ..." if len(differ) > 5 else "")
        )
    return compared


def check_engine(
    url: str,
    version: str,
    headers: dict[str, str],
    timeout_s: float,
    checks: RefitChecksums,
    answered: list[dict[str, str]] | None = None,
) -> None:
    """One engine's checksums against the trainer's (`compare_checksums`); the time waited for the engine's
    answer is added to ``checks.engine_seconds``, and the names it reported become ``checks.reported``.
    ``answered``: the engine's checksums by TP rank, already at hand (nothing is asked)."""
    start = time.perf_counter()
    engine = answered if answered is not None else engine_checksums(url, headers, timeout_s, version)
    checks.engine_seconds += time.perf_counter() - start
    checks.reported.update(name for rank in engine for name in rank)
    compare_checksums(url, checks.expected, engine, version)


def verify_refit(
    urls: list[str], version: str, headers: dict[str, str], timeout_s: float, checks: RefitChecksums | None
) -> None:
    """After a refit: every engine serves ``version``; with ``checks`` (``check_equal``), each engine's
    per-tensor checksums equal the trainer's (`check_engine`)."""
    verify_versions(urls, version, headers, timeout_s)
    if checks is None:
        return
    for url in urls:
        check_engine(url, version, headers, timeout_s, checks)


def engine_hash_kind(url: str, headers: dict[str, str], timeout_s: float, default: str) -> str:
    """The checksum kind of the engine at ``url``, from the device its ``/server_info`` names (SGLang and the
    embedded engine both report ``device``); ``default`` when it names none."""
    device = get_engine_json(url, "server_info", headers, timeout_s, "checksum kind").get("device")
    return device_hash_kind(device) if isinstance(device, str) and device else default


def engines_have_windows(urls: list[str], headers: dict[str, str], timeout_s: float) -> bool:
    """Whether every engine serves the window endpoints (the embedded engine does, SGLang answers 404)."""
    for url in urls:
        try:
            request("POST", url, LAYOUT_ENDPOINT, "window probe", timeout_s, headers, {})
        except EngineStatusError:
            return False
    return True
