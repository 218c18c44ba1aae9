"""Checks of the server pass-through flags that need packages above the config, run in the same validation pass
as the config's own rules by the driver's `parse_config` (so `--dry-run` fails on them too, in one error).

- `--router-*` flags through sglang-router's own parser, and a running router (`--sglang-router-ip/-port`);
- `--sglang-*` flags that miles sets itself (refused), and every `--sglang-*` flag through SGLang's own parser
  where SGLang is installed (`check_sglang_flags`);
- `--rollout-external-engine-addrs`: each a well-formed HOST:PORT, each once;
- `--train-backend` and `--router-policy` against their registries (the config lists them as constants).

`Config.from_dict` runs none of these: SGLang's parser imports torch, which a training process must not pay for.
"""

from __future__ import annotations

from contextlib import suppress

from miles.config import Config
from miles.config.parser import DEFAULT_PROG
from miles.config.parser import parse_config as parse_config_only
from miles.config.values import Rule, Skip, Values


def parse_config(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> Config:
    """`miles.config.parse_config` with the server-flag checks of this module in the same pass: what the driver,
    `--dry-run` and the tools call. Raises ConfigError listing every violation."""
    return parse_config_only(argv, prog, rules=SERVER_FLAG_RULES)


def _external_engine_addrs(v: Values) -> None:
    """--rollout-external-engine-addrs: well-formed HOST:PORT (the engines' own form), each once."""
    if not v["rollout_external"] or not v["rollout_external_engine_addrs"]:
        return
    from miles.engines.external import engine_url

    try:
        urls = [engine_url(a) for a in v["rollout_external_engine_addrs"]]
        if len(set(urls)) != len(urls):
            v.fail("rollout_external_engine_addrs", "names an engine twice")
    except ValueError as e:
        v.fail("rollout_external_engine_addrs", str(e))


def _registries(v: Values) -> None:
    """The choices the config lists as constants (`miles.config.registry_names`) are in their registries now."""
    from miles.backends import available_backends

    with suppress(Skip):
        if v["train_backend"] not in available_backends():
            v.fail("train_backend", f"must be one of {{{', '.join(available_backends())}}}")
    with suppress(Skip):
        policy = v["router_policy"]
        if policy is not None:
            from miles.engines.router_args import router_policies

            try:
                policies = router_policies()
            except ImportError as e:  # sglang-router is not installed
                v.fail("router_policy", f"cannot be checked: {e}")
                return
            if policy not in policies:
                v.fail("router_policy", f"must be one of {{{', '.join(policies)}}}")


def _router(v: Values) -> None:
    """--router-* pass-through flags (checked with sglang-router's own parser) and an external router."""
    with suppress(Skip):
        from miles.engines.router_args import router_arg_problems

        args = v["router_args"]
        for given, problem in router_arg_problems(args):
            v.violations.append(f"{given}: {problem}")
            v.bad.add("router_args")
    ip, port = v["sglang_router_ip"], v["sglang_router_port"]
    if (ip is None) != (port is None):
        missing = "sglang_router_port" if port is None else "sglang_router_ip"
        v.missing(
            missing, "to use a running sglang-router (give --sglang-router-ip and --sglang-router-port)"
        )
        return
    if ip is None:
        return
    if v["router_args"]:
        from miles.engines.router_args import flag_of

        flags = ", ".join(flag_of(name) for name in v["router_args"])
        v.violations.append(
            f"{flags}: configure a router miles launches; the running router at "
            "--sglang-router-ip/--sglang-router-port keeps its own options: drop them"
        )
        v.bad.add("router_args")
    if v["router_policy"] is not None:
        v.fail(
            "router_policy",
            "the running router at --sglang-router-ip/--sglang-router-port keeps its own policy: drop it",
        )


def _sglang_passthrough(v: Values) -> None:
    """--sglang-* flags that miles sets itself (refused with the reason, SGLang installed or not)."""
    from miles.engines.sglang_args import owned_problems

    for given, problem in owned_problems(v["sglang_args"]):
        v.violations.append(f"{given}: {problem}")
        v.bad.add("sglang_args")


def check_sglang_flags(v: Values) -> None:
    """Every `--sglang-*` flag through SGLang's own parser, launched as miles launches it: a bad name or value
    is a violation naming the flag and quoting SGLang. Only where SGLang is installed and flags were given
    (SGLang's server arguments import torch), and not for engines miles does not launch with them (`--rollout-engine
    local`, external engines)."""
    from miles.engines.sglang_args import parser_problems, sglang_installed

    with suppress(Skip):
        # v.values: also when a miles-owned flag made it bad (the others are still checked)
        args = v.values["sglang_args"]
        if not args or v["rollout_engine"] == "local" or v["rollout_external"] or not sglang_installed():
            return
        for given, problem in parser_problems(args):
            v.violations.append(f"{given}: {problem}")
            v.bad.add("sglang_args")


SERVER_FLAG_RULES: list[Rule] = [
    _registries,
    _external_engine_addrs,
    _router,
    _sglang_passthrough,
    check_sglang_flags,
]
