"""The trainer's side of the refit endpoints: its HTTP calls to rollout engines around a refit (session,
verification, the weight-window probe). The engine's side of the same endpoints: `miles.engines.local.control`
(embedded) or SGLang's HTTP server. Generation is the rollout's (`miles.rollout.generate_client`); engine
memory control and health are `miles.utils.engine_control_http`'s.

Calls go through `miles.utils.engine_control_http`, so every failure names the engine, the endpoint, what it
was doing and the phase. The rules are SGLang 0.5.23's (docs/sglang-contract.md): a refit runs inside
``/begin_weight_update`` ... ``/end_weight_update``; the weight version an engine serves is the
``weight_version`` of ``/model_info``; ``/weights_checker`` with action ``checksum`` answers per-tensor checksums
(`miles.utils.weight_checksum`).
"""

from __future__ import annotations

from collections.abc import Iterable

from miles.utils.engine_control_http import EngineStatusError, get_engine_json, post_engine, request

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


def engine_checksums(url: str, headers: dict[str, str], timeout_s: float, version: str) -> dict[str, str]:
    """The per-tensor checksums an engine reports (``/weights_checker``, action checksum; TP rank 0)."""
    answer = post_engine(
        url, "weights_checker", {"action": "checksum"}, headers, timeout_s, f"checksums after refit {version}"
    )
    ranks = answer.get("ranks") or []
    if not isinstance(ranks, list) or not ranks:
        raise RuntimeError(f"engine {url}, weights_checker: no per-rank checksums in {answer}")
    sums = ranks[0].get("checksums") if isinstance(ranks[0], dict) else None
    if not isinstance(sums, dict):
        raise RuntimeError(f"engine {url}, weights_checker: rank 0 reports no 'checksums' object in {answer}")
    return {name: str(value) for name, value in sums.items()}


def compare_checksums(url: str, trainer: dict[str, str], engine: dict[str, str], version: str) -> int:
    """Raise naming every tensor whose checksum differs; returns the number compared. Tensors the engine
    names differently (SGLang fuses q/k/v and gate/up) are not comparable; at least one must be."""
    common = sorted(set(trainer) & set(engine))
    if not common:
        raise RuntimeError(
            f"engine {url}: no tensor name in common with the trainer to compare checksums after refit "
            f"{version} (engine names e.g. {sorted(engine)[:4]})"
        )
    differ = [n for n in common if trainer[n] != engine[n]]
    if differ:
        raise RuntimeError(
            f"engine {url}: after refit {version}, {len(differ)} of {len(common)} tensors differ from the "
            f"trainer's (checksum), e.g. {differ[:5]}"
        )
    return len(common)


def verify_refit(
    urls: list[str], version: str, headers: dict[str, str], timeout_s: float, checksums: dict[str, str] | None
) -> None:
    """After a refit: every engine serves ``version``; with ``checksums`` (``check_equal``), each engine's
    per-tensor checksums equal these trainer-side ones."""
    verify_versions(urls, version, headers, timeout_s)
    if checksums is None:
        return
    for url in urls:
        compare_checksums(url, checksums, engine_checksums(url, headers, timeout_s, version), version)


def engines_have_windows(urls: list[str], headers: dict[str, str], timeout_s: float) -> bool:
    """Whether every engine serves the window endpoints (the embedded engine does, SGLang answers 404)."""
    for url in urls:
        try:
            request("POST", url, LAYOUT_ENDPOINT, "window probe", timeout_s, headers, {})
        except EngineStatusError:
            return False
    return True
