#!/usr/bin/env bash
# Makes .venv-sglang: released sglang 0.5.23 without its CUDA dependencies, for the conformance suite
# (tests/integration/test_sglang_conformance.py). A side venv of the calling Python (scripts/side_venv.py): it sees
# that interpreter's packages (torch, transformers, fastapi, uvicorn, miles' dependencies: a venv's or the
# system's, whichever runs this) and adds what SGLang's HTTP front-end imports on top, listed below, pinned to the
# caller's versions so nothing pulls a CUDA torch. torchvision is replaced by a test shim
# (tests/sglang_conformance/shim): the PyPI wheel cannot register its ops on our CPU torch. Cached by a stamp; a
# second run takes a second or two. Exit 0 with a message when it cannot be made (no network): the suite then
# skips and says why, or fails under CI=true.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MILES_SGLANG_VENV:-.venv-sglang}
# imported by SGLang's front-end and installed with their dependencies (torch pinned as above); the calling
# environment normally has all but IPython (sglang.utils imports it)
DEPS=("torch" "transformers" "fastapi" "uvicorn" "httpx" "requests" "numpy" "pydantic" "aiohttp" "orjson" "ipython")
# installed without: sglang's own dependencies include CUDA kernels and a CUDA torch
NO_DEPS=(
  "sglang==0.5.23" "triton" "apache-tvm-ffi==0.1.11" "msgspec" "pyzmq" "uvloop" "pybase64" "psutil" "pillow"
  "dill" "sentencepiece==0.2.1" "compressed-tensors" "loguru" "gguf" "openai" "partial_json_parser" "einops"
  "xgrammar" "soundfile" "python-multipart"
)
if "$PY" scripts/side_venv.py --label sglang-venv --venv "$VENV" --stamp .miles-sglang-ok --project-deps \
    --check "import sglang.srt.entrypoints.http_server, fake_scheduler, miles.engines.sglang_launch" \
    --check-path "$PWD/tests/sglang_conformance/shim" "$PWD/tests/sglang_conformance" "$PWD" \
    --no-deps "${NO_DEPS[@]}" -- "${DEPS[@]}"; then
  echo "[sglang-venv] $VENV is ready"
else
  echo "[sglang-venv] cannot make $VENV: the conformance tests will skip (and fail under CI=true)"
fi
exit 0
