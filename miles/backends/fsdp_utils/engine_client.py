"""The trainer's HTTP calls to rollout engines during a refit: session, buckets, verification.

Every call names the engine, the endpoint and what it was doing when it fails. The rules are SGLang 0.5.23's
(docs/sglang-contract.md): a refit runs inside ``/begin_weight_update`` ... ``/end_weight_update``; the weight
version an engine serves is the ``weight_version`` of ``/model_info``; ``/weights_checker`` with action
``checksum`` answers per-tensor checksums (`miles.utils.weight_checksum`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import httpx

_CLIENT: httpx.Client | None = None
_CLIENT_LOCK = threading.Lock()


def http_client() -> httpx.Client:
    """The process's one HTTP client for engine control calls (its connection pool and TLS context are built
    once, not per call); each call passes its own timeout and headers."""
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None:
            _CLIENT = httpx.Client()
        return _CLIENT


def post_engine(
    url: str, endpoint: str, body: dict, headers: dict[str, str], timeout_s: float, what: str
) -> dict:
    """POST ``body`` to ``{url}/{endpoint}`` and require ``success``; errors name the engine, ``what`` and the
    phase (request: no answer in time / connection; status: non-200; response: not JSON or success=false)."""
    where = f"engine {url}, {endpoint}, {what}"
    try:
        resp = http_client().post(f"{url}/{endpoint}", json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"{where}, phase request: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise RuntimeError(f"{where}, phase status: HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        answer = resp.json()
    except ValueError as exc:
        raise RuntimeError(f"{where}, phase response: not JSON: {resp.text[:500]!r}") from exc
    if not isinstance(answer, dict) or not answer.get("success", False):
        message = answer.get("message", answer) if isinstance(answer, dict) else answer
        raise RuntimeError(f"{where}, phase response: success=false: {message}")
    return answer


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


def get_engine_json(url: str, path: str, headers: dict[str, str], timeout_s: float, what: str) -> dict:
    """GET ``{url}{path}`` as JSON; errors name the engine and ``what``."""
    try:
        resp = http_client().get(f"{url}{path}", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"engine {url}, GET {path}, {what}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise RuntimeError(f"engine {url}, GET {path}, {what}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def verify_versions(urls: list[str], version: str, headers: dict[str, str], timeout_s: float) -> None:
    """Every engine must serve ``version`` (``weight_version`` of ``/model_info``)."""
    wrong = []
    for url in urls:
        got = get_engine_json(url, "/model_info", headers, timeout_s, f"weight check after refit {version}")
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
    if not ranks:
        raise RuntimeError(f"engine {url}, weights_checker: no per-rank checksums in {answer}")
    return dict(ranks[0]["checksums"])


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
