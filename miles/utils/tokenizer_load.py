"""The tokenizer of processes that hold no model (the rollout manager): what `AutoTokenizer.from_pretrained` loads,
without the torch import it brings along.

`AutoTokenizer` reads the model's config through `transformers.configuration_utils`, which imports torch (~130 MB
of PSS in a process that never makes a tensor). A local checkpoint whose tokenizer_config.json names the generic
class (`PreTrainedTokenizerFast` / `TokenizersBackend`), with a tokenizer.json and no `auto_map`, is loaded by
`AutoTokenizer` as `TokenizersBackend` from that directory; that class is imported without torch and loaded
directly here. Every other checkpoint (a model-specific class, remote code, a model type transformers overrides
the declared class of, Mistral's tekken files, a hub name) goes through `AutoTokenizer` as before.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
from typing import Any

GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(path: str) -> Any:
    """`AutoTokenizer.from_pretrained(path)`'s tokenizer; without importing torch where `direct_class` allows."""
    from miles.utils.lazy_import import gc_paused
    from miles.utils.transformers_scan import install

    install()  # transformers' scan of its model folder from the cache (~0.28 s of CPU)
    with gc_paused():  # transformers' import: no collection walks its objects meanwhile
        if direct_class(path):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


def direct_class(path: str) -> bool:
    """True when `AutoTokenizer` would load `path` as the generic `TokenizersBackend` (see the module doc)."""
    config = _json(os.path.join(path, "tokenizer_config.json"))
    if config is None or not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return False
    if config.get("tokenizer_class") not in GENERIC_CLASSES or "auto_map" in config:
        return False
    if os.path.exists(os.path.join(path, "tekken.json")):
        return False
    model_type = (_json(os.path.join(path, "config.json")) or {}).get("model_type")
    overridden = _overridden_model_types()
    return overridden is not None and model_type not in overridden


def _json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@functools.cache
def _overridden_model_types() -> frozenset[str] | None:
    """The model types whose declared tokenizer class `AutoTokenizer` replaces
    (`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` in transformers' tokenization_auto.py), read from that module's
    source: importing it imports torch. None when it cannot be read (then nothing loads directly)."""
    # the file is found from the top-level package's spec: finding the submodule's would import the packages
    # above it, transformers.models among them (~0.6 s of CPU scanning every model's folder)
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return None
    origin = os.path.join(os.path.dirname(spec.origin), "models", "auto", "tokenization_auto.py")
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target: ast.expr
        value: ast.expr | None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if (
            isinstance(target, ast.Name)
            and target.id == "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS"
            and value
        ):
            try:
                return frozenset(ast.literal_eval(value))
            except ValueError:
                return None
    return None
    return None
