#!/usr/bin/env bash
# Makes .venv-sglang: released sglang 0.5.23 without its CUDA dependencies, for the conformance suite
# (tests/integration/test_sglang_conformance.py). The venv sees the system site-packages (torch 2.13 CPU,
# transformers, fastapi, uvicorn), so nothing pulls a CUDA build; what SGLang's HTTP front-end imports on top is
# listed below. torchvision is replaced by a test shim (tests/sglang_conformance/shim): the PyPI wheel cannot
# register its ops on our CPU torch. Cached: a stamp records the package list; a second run takes seconds.
# Exit 0 with a message when sglang cannot be installed (no network): the suite then skips and says why.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MILES_SGLANG_VENV:-.venv-sglang}
PKGS=(
  "sglang==0.5.23" "triton" "apache-tvm-ffi==0.1.11" "msgspec" "pyzmq" "uvloop" "pybase64" "psutil" "pillow"
  "dill" "sentencepiece==0.2.1" "compressed-tensors" "loguru" "gguf" "openai" "partial_json_parser" "einops"
  "xgrammar" "soundfile" "python-multipart"
)
stamp="$VENV/.miles-sglang-ok"
want="$(printf '%s\n' "${PKGS[@]}" | sha1sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[sglang-venv] $VENV is ready"
  exit 0
fi
rm -f "$stamp"
echo "[sglang-venv] making $VENV (sglang 0.5.23, no CUDA dependencies)"
"$PY" -m venv --system-site-packages "$VENV" || { echo "[sglang-venv] cannot make a venv: conformance tests will skip"; exit 0; }
if ! "$VENV/bin/pip" install -q --no-deps "${PKGS[@]}" 2>&1 | grep -v "is ignored"; then :; fi
if PYTHONPATH=tests/sglang_conformance/shim "$VENV/bin/python" -W ignore -c "import sglang.srt.entrypoints.http_server" \
    >/dev/null 2>"$VENV/import-error.log"; then
  echo "$want" > "$stamp"
  echo "[sglang-venv] ready"
else
  echo "[sglang-venv] sglang's HTTP front-end does not import (see $VENV/import-error.log): conformance tests will skip"
fi
exit 0
