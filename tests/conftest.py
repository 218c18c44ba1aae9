"""Suite-wide setup: no model hub, no tokenizer thread pools, unbuffered output (set once, before any test)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONUNBUFFERED", "1")
