"""Choices the command line lists that registries outside `miles.config` own, as plain constants.

The config is the floor every package reads, so it imports nothing from `miles.backends` or `miles.engines`
(tests/unit/test_import_rules.py). tests/unit/test_registry_names.py checks these tuples against their
registries: a backend registered in `miles.backends`, or a policy sglang-router adds, without being listed
here fails a test rather than being unselectable (or wrongly selectable) from the CLI.
"""

from __future__ import annotations

# miles.backends.available_backends()
TRAIN_BACKENDS: tuple[str, ...] = ("fsdp",)
# miles.engines.router_args.router_policies(): sglang-router's --policy choices
ROUTER_POLICIES: tuple[str, ...] = ("random", "round_robin", "cache_aware", "power_of_two", "manual")
