"""Pre-flight: the checks of a run's configuration that need more than the configuration itself, run by the
driver before Ray starts (and by `--dry-run`), so bad input fails in a second with a message naming its flag.

- `parse_config` (`server_flags`): parse and validate, with the server pass-through flags checked by SGLang's
  and sglang-router's own parsers in the same pass and error;
- `run_preflight` (`checks`): files, models, checkpoints, rewards and user functions of a parsed Config.

`miles.config` imports nothing from rollout, backends or engines; this package may.
"""

from miles.preflight.checks import PreflightError, run_preflight
from miles.preflight.server_flags import parse_config

__all__ = ["PreflightError", "parse_config", "run_preflight"]
