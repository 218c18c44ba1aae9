"""--router-* flags (checked with sglang-router's own parser, passed to it as its own options), the routing
decision, a running router, and external engines (--rollout-external-engine-addrs): validation, the handle's
owner rules and the refit-path check."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from miles.config import ConfigError
from miles.config.core import Config
from miles.engines.external import ExternalEngine, engine_url, refit_path_problems
from miles.engines.router import Router, generation_via_router, merge_args, resilience_args
from miles.engines.router_args import router_command_args, router_policies
from miles.preflight import parse_config
from miles.ray.engine_health import HealthMonitor, HealthSettings
from miles.rollout.generate_batching import batching
from miles.rollout.generate_client import GenerateClient

BASE = [
    "--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--rm-type", "math", "--num-rollout", "1",
    "--rollout-batch-size", "4", "--global-batch-size", "4", "--colocate",
]  # fmt: skip


def problems(extra: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + extra)
    return str(e.value)


# ------------------------------------------------------------------------------------------ router flags
def test_policies_are_sglang_routers_own():
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    (policy,) = [a for a in parser._actions if "--policy" in a.option_strings]
    assert router_policies() == tuple(policy.choices)
    assert {"random", "round_robin", "cache_aware", "power_of_two"} <= set(router_policies())


def test_good_router_flags_reach_sglang_routers_command_line():
    from sglang_router.launch_router import parse_router_args

    cfg = parse_config(
        BASE + ["--router-policy", "cache_aware", "--router-cache-threshold", "0.3", "--router-dp-aware",
                "--router-request-id-headers", "x-a", "x-b", "--router-health-check-timeout-secs", "7"]
    )  # fmt: skip
    assert cfg.router.router_policy == "cache_aware"
    assert cfg.router.router_args == {
        "cache_threshold": "0.3",
        "dp_aware": "true",
        "request_id_headers": "x-a x-b",
        "health_check_timeout_secs": "7",
    }
    extra = merge_args(resilience_args(90), router_command_args(dict(cfg.router.router_args)))
    router = Router(["http://127.0.0.1:9"], port=1234, policy="cache_aware", extra_args=extra)
    parsed = parse_router_args(router.command()[3:])  # after `python -m sglang_router.launch_router`
    assert parsed.policy == "cache_aware" and parsed.cache_threshold == 0.3 and parsed.dp_aware
    assert parsed.request_id_headers == ["x-a", "x-b"]
    assert parsed.health_check_timeout_secs == 7  # the user's value replaces miles's 30
    assert parsed.disable_circuit_breaker and parsed.request_timeout_secs == 90  # what miles always sets
    assert parsed.worker_urls == ["http://127.0.0.1:9"] and parsed.port == 1234


def test_keyed_workers_are_registered_with_their_key_off_the_command_line():
    """Workers that take a key are registered by POST /workers with it (test_sglang_conformance runs this against
    SGLang's server): the router's command line, readable in /proc, names neither the workers nor the key."""
    from sglang_router.launch_router import parse_router_args

    router = Router(["http://127.0.0.1:9"], port=1234, worker_api_key="run-key")
    command = router.command()
    assert "run-key" not in " ".join(command) and "--api-key" not in command
    assert parse_router_args(command[3:]).worker_urls == []


def test_router_flags_round_trip_through_a_dict_and_yaml(tmp_path):
    cfg = parse_config(BASE + ["--router-cache-threshold", "0.3", "--router-log-level", "info"])
    assert Config.from_dict(cfg.to_dict()).router == cfg.router
    run = tmp_path / "run.yaml"
    run.write_text("router:\n  router_cache_threshold: 0.3\n  router_request_id_headers: [x-a, x-b]\n")
    cfg = parse_config(BASE + ["--config", str(run)])
    assert cfg.router.router_args == {"cache_threshold": "0.3", "request_id_headers": "x-a x-b"}


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--router-policy", "fastest"], "--router-policy='fastest': must be one of {random, round_robin"),
        (["--router-cache-threshold", "abc"], "--router-cache-threshold='abc': sglang-router refuses 'abc'"),
        (["--router-log-level", "loud"], "--router-log-level='loud': sglang-router refuses 'loud'"),
        (["--router-cache-treshold", "0.3"], "--router-cache-treshold='0.3': sglang-router has no such option "
                                             "(did you mean '--router-cache-threshold'?)"),
        (["--router-dp-aware", "maybe"], "--router-dp-aware='maybe': sglang-router refuses 'maybe': is a switch"),
        (["--router-request-timeout-secs", "5"], "--router-request-timeout-secs='5': cannot be passed through: "
                                                 "it is derived from --rollout-request-timeout"),
        (["--router-disable-circuit-breaker"], "--router-disable-circuit-breaker='true': cannot be passed through"),
        (["--router-cb-failure-threshold", "3"], "--router-cb-failure-threshold='3': has no effect"),
        (["--router-pd-disaggregation"], "--router-pd-disaggregation='true': cannot be passed through"),
    ],
)  # fmt: skip
def test_bad_router_flags_are_named(extra, expected):
    assert expected in problems(extra)


def test_every_bad_router_flag_is_reported_at_once():
    text = problems(["--router-cache-threshold", "x", "--router-bogus", "1", "--router-policy", "nope"])
    assert "3 problems" in text
    for flag in ("--router-cache-threshold", "--router-bogus", "--router-policy"):
        assert flag in text


def test_running_router_needs_ip_and_port_and_keeps_its_own_options():
    assert "--sglang-router-port is required" in problems(["--sglang-router-ip", "10.0.0.1"])
    assert "--sglang-router-ip is required" in problems(["--sglang-router-port", "3000"])
    running = ["--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "3000"]
    text = problems(running + ["--router-policy", "random", "--router-cache-threshold", "0.1"])
    assert "--router-policy='random': the running router" in text
    assert "--router-cache-threshold: configure a router miles launches" in text
    assert parse_config(BASE + running).router.sglang_router_port == 3000


def test_merge_args_lets_the_user_replace_a_default():
    defaults = ["--log-level", "warn", "--retry-max-backoff-ms", "2000", "--disable-circuit-breaker"]
    assert merge_args(defaults, ["--log-level", "info", "--x", "a", "b"]) == [
        "--retry-max-backoff-ms", "2000", "--disable-circuit-breaker", "--log-level", "info", "--x", "a", "b",
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------ routing decision
@pytest.mark.parametrize(
    "policy, running, via",
    [(None, False, False), ("round_robin", False, True), ("cache_aware", False, True), (None, True, True)],
)
def test_generation_goes_through_the_router_only_when_asked(policy, running, via):
    assert generation_via_router(policy, running) is via


def _client_calls(via_router: bool) -> list[str]:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(200, json={"workers": [{"url": "http://e0:1"}, {"url": "http://e1:1"}]})
        body = json.loads(request.content)
        seen.append(f"{request.url.host}{request.url.path}:{'batch' if isinstance(body['rid'], list) else 1}")
        n = len(body["rid"]) if isinstance(body["rid"], list) else 1
        one = {"text": "7", "output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"}}}
        return httpx.Response(200, json=[one] * n if isinstance(body["rid"], list) else one)

    async def go():
        async with GenerateClient(
            "http://router:1", ["http://e0:1", "http://e1:1"], None, 5.0, 8,
            transport=httpx.MockTransport(handler), via_router=via_router,
        ) as client:  # fmt: skip
            with batching("group0"):
                await asyncio.gather(
                    *(
                        client.generate([1], {"max_new_tokens": 1}, i, "rollout 0", rid=f"r{i}")
                        for i in range(3)
                    )
                )

    asyncio.run(go())
    return seen


def test_via_router_every_generation_goes_to_the_router_alone():
    assert _client_calls(via_router=True) == ["router/generate:1"] * 3


def test_direct_path_batches_a_group_to_one_engine():
    assert _client_calls(via_router=False) in (["e0/generate:batch"], ["e1/generate:batch"])


# ------------------------------------------------------------------------------------------ external engines
@pytest.mark.parametrize(
    "addr, url",
    [
        ("10.0.0.5:30000", "http://10.0.0.5:30000"),
        ("http://host-a:8000/", "http://host-a:8000"),
        ("[::1]:31000", "http://[::1]:31000"),
    ],
)
def test_engine_addresses(addr, url):
    assert engine_url(addr) == url


@pytest.mark.parametrize("addr", ["10.0.0.5", "host:port", "ftp://h:1", "h:1/generate", ":300"])
def test_bad_engine_addresses_are_named(addr):
    assert f"--rollout-external-engine-addrs=['{addr}']" in problems(
        ["--no-colocate", "--rollout-external-engine-addrs", addr]
    )


def test_external_engines_take_no_placement_and_are_checked():
    ext = ["--no-colocate", "--rollout-external-engine-addrs", "127.0.0.1:31000", "127.0.0.1:31001"]
    cfg = parse_config(BASE + ext)
    assert cfg.cluster.rollout_external and cfg.cluster.rollout_num_gpus is None
    assert "--colocate=True: needs engines miles launches" in problems(ext[1:])
    assert "--rollout-num-gpus=3: with external engines is only a check: 2 engine(s)" in problems(
        ext + ["--rollout-num-gpus", "3"]
    )
    assert parse_config(BASE + ext + ["--rollout-num-gpus", "2"]).cluster.rollout_num_gpus == 2
    assert "names an engine twice" in problems(
        ["--no-colocate", "--rollout-external-engine-addrs", "h:1", "h:1"]
    )
    assert "--rollout-external-engine-addrs is required with --rollout-external" in problems(
        ["--no-colocate", "--rollout-external"]
    )


def test_an_external_engine_is_never_restarted_or_stopped():
    engine = ExternalEngine("127.0.0.1:9")
    with pytest.raises(
        RuntimeError, match=r"engine http://127.0.0.1:9 is external \(--rollout-external-engine"
    ):
        engine.restart()
    engine.shutdown()
    engine.kill()  # neither has a process to stop: no error
    assert engine.pid is None


def test_health_monitor_names_a_failed_external_engine():
    engine = ExternalEngine("127.0.0.1:9")
    out: list[str] = []
    monitor = HealthMonitor(
        [engine.url],
        HealthSettings(interval=0.05, timeout=1, first_wait=0),
        check=lambda url, timeout: "connection refused",
        take_out=out.append,
        restart=lambda url: engine.restart(),
    )
    try:
        monitor.start_watch()
        with pytest.raises(RuntimeError, match=r"http://127.0.0.1:9 could not be restarted: .*is external"):
            monitor.stop_watch(timeout=10)
        assert out == [engine.url]  # taken out of the router first
    finally:
        monitor.close()


def test_refit_path_of_external_engines():
    here, there = "http://127.0.0.1:31000", "http://192.0.2.7:31000"  # 192.0.2.0/24: documentation range
    assert refit_path_problems([here], use_gpu=False, actor_world_size=1, per_engine=1) == []
    (problem,) = refit_path_problems([there], use_gpu=False, actor_world_size=1, per_engine=1)
    assert problem.startswith(f"external engine {there} is not on this machine")
    assert refit_path_problems([there], use_gpu=True, actor_world_size=1, per_engine=1) == []
    (problem,) = refit_path_problems([here, here + "1"], use_gpu=False, actor_world_size=1, per_engine=1)
    assert "2 external engine(s)" in problem and "the trainer has 1" in problem


def test_router_process_only_when_the_run_needs_one():
    from miles.ray.engine_fleet import router_needed

    assert not router_needed(parse_config(BASE))  # the client routes by itself: no router process
    for extra in (
        ["--router-policy", "cache_aware"],
        ["--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "3000"],
        ["--use-fault-tolerance"],  # the health monitor keeps the admitted engines in the router's list
        ["--router-log-level", "info"],  # a router option asks for a router
    ):
        assert router_needed(parse_config(BASE + extra)), extra
