"""The rollout manager's tokenizer (`miles.utils.tokenizer_load`) of a checkpoint declaring the generic tokenizer
class loads in a fresh process without importing torch (it would cost that process ~130 MB)."""

from __future__ import annotations

import subprocess
import sys


def test_generic_class_imports_no_torch(tmp_path) -> None:
    from miles.tools.tiny_model import build_tokenizer

    build_tokenizer("echo").save_pretrained(tmp_path)
    code = (
        "import sys; from miles.utils.tokenizer_load import load_tokenizer; "
        f"t = load_tokenizer({str(tmp_path)!r}); print(type(t).__name__, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["TokenizersBackend", "False"], out.stderr
