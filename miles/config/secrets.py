"""Where secrets (fields declared `secret=True`: API keys) come from, and warnings when they sit where other local
users can read them.

A command line is readable by every local user (`/proc/<pid>/cmdline`, `ps`), so a secret should come from the
environment (`MILES_<FIELD>`, e.g. `MILES_ENGINE_API_KEY` for `--engine-api-key`) or from a `--config` file only
its owner can read (`chmod 600`). The environment sits below `--config` and the command line in the merge.
Both warnings go through `logging` before it is configured, so Python's last-resort handler prints them.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping

from miles.config.schema import FIELDS

logger = logging.getLogger(__name__)

ENVIRONMENT = "environment"  # the merge source that names values read from the environment


def secret_fields() -> list[str]:
    """Names of the fields declared secret."""
    return [name for name, spec in FIELDS.items() if spec.meta("secret")]


def env_var(name: str) -> str:
    """The environment variable a secret field is read from: MILES_ and its name in capitals."""
    return "MILES_" + name.upper()


def from_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The secret fields set (non-empty) in `environ`, by field name."""
    return {name: environ[env_var(name)] for name in secret_fields() if environ.get(env_var(name))}


def where_to_put(flags: list[str]) -> str:
    """Advice naming, for each secret flag, its environment variable."""
    by_flag = {FIELDS[n].flag: env_var(n) for n in secret_fields()}
    names = ", ".join(f"{flag} as ${by_flag[flag]}" for flag in flags)
    return (
        f"set {names} in the environment, or put them in a --config file only you can read (chmod 600); "
        "a command line is readable by every local user (/proc/<pid>/cmdline)"
    )


def warn_on_command_line(given: list[str]) -> None:
    """Warn when secret fields (`given`, field names) were set on the command line."""
    if given:
        flags = [FIELDS[n].flag for n in given]
        logger.warning("%s given on the command line: %s", ", ".join(flags), where_to_put(flags))


def warn_if_readable(path: str, secrets: list[str]) -> None:
    """Warn when the `--config` file at `path` sets secret fields (`secrets`) and its group or others may read it."""
    if not secrets:
        return
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        flags = ", ".join(FIELDS[n].flag for n in secrets)
        logger.warning(
            "--config %s sets %s and is readable by other users (mode %03o): run chmod 600 %s",
            path, flags, mode, path,
        )  # fmt: skip
