"""FSDP2 on 2 gloo CPU ranks: sharded logits, reference model, DP=2 step == DP=1 step, CPU offload no-op,
bucketed refit of the sharded model to (fake, in-test HTTP) colocated engines."""

from __future__ import annotations

import collections
import http.server
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _util import free_port, run_distributed, save_tiny_qwen3
from safetensors.torch import load_file

from miles.backends.fsdp_utils.hf_load import load_hf_model
from miles.backends.fsdp_utils.model import (
    apply_fsdp2,
    build_fsdp_model,
    build_optimizer,
    build_reference_model,
    clip_grad_norm_sharded,
    default_defer_gradient_sync,
    per_layer_units,
    sync_gradients_after,
)
from miles.backends.fsdp_utils.offload import load_to_device, offload_to_cpu
from miles.backends.fsdp_utils.parallel import ParallelDims, init_distributed
from miles.refit.broadcast import DistributedWeightUpdater
from miles.refit.buckets import iter_weight_buckets, plan_weight_buckets
from miles.refit.session import RefitSetup
from miles.refit.tensor_handles import ColocatedWeightUpdater
from miles.utils.serialization import deserialize
from miles.utils.side_group import init_side_group

VOCAB = 96


def _batch(seed: int = 1, n: int = 4, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=g)


def _token_ce_sum(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Sum over all predicted tokens of the next-token cross entropy."""
    logits = model(input_ids=tokens).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1), reduction="sum"
    )


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def _sharded_logits_body(rank: int, world_size: int, path: str) -> None:
    state = init_distributed("gloo", timeout_s=60)
    assert (state.dp_size, state.cp_size, state.dp_rank, state.is_cuda) == (2, 1, rank, False)
    cp = init_distributed("gloo", timeout_s=60, cp_size=2)  # reuses the group; a (1, 2) mesh
    assert (cp.dp_size, cp.cp_size, cp.dp_rank, cp.cp_rank) == (1, 2, 0, rank)
    assert cp.fsdp_mesh.size() == 2 and dist.get_world_size(cp.cp_group) == 2
    assert dist.get_world_size(cp.dp_group) == 1

    plain = load_hf_model(path)
    tokens = _batch()
    with torch.no_grad():
        expected = plain(input_ids=tokens).logits

    model = build_fsdp_model(path, state.fsdp_mesh, torch.float32, torch.float32, cpu_offload=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings came untied"
    assert model.config.use_cache is False
    with torch.no_grad():
        got = model(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for name, p in _full_params(model).items():
        torch.testing.assert_close(p, plain.get_parameter(name).detach(), atol=0, rtol=0, msg=name)

    ref_model = build_reference_model(path, state.fsdp_mesh)
    assert not ref_model.training and not any(p.requires_grad for p in ref_model.parameters())
    with torch.no_grad():
        ref_logits = ref_model(input_ids=tokens).logits
    torch.testing.assert_close(ref_logits, expected, atol=1e-5, rtol=1e-5)


def _fsdp_adam_step(
    path: str, state, local: torch.Tensor, scale: float, offload: bool, grad_ckpt: bool = False
) -> torch.nn.Module:
    """Build the FSDP2 model and take one AdamW step on ``local`` (loss: token CE sum * scale)."""
    model = build_fsdp_model(path, state.fsdp_mesh, gradient_checkpointing=grad_ckpt)
    opt = build_optimizer(model.parameters(), "adam", lr=1e-3, weight_decay=0.1, eps=1e-6)
    if offload:
        offload_to_cpu(model, opt)
        load_to_device(model, opt, state.device)
    (_token_ce_sum(model, local) * scale).backward()
    opt.step()
    if offload:
        offload_to_cpu(model, opt)
        load_to_device(model, opt, state.device)
    return model


def _dp_step_body(rank: int, world_size: int, path: str) -> None:
    state = init_distributed(None, timeout_s=60)
    tokens = _batch(n=4)
    n_pred = tokens[:, 1:].numel()

    # Adam's first step is ~lr * g / (|g| + eps): for near-zero grads it amplifies fp32 reduction-order noise
    # by lr / eps, so eps is 1e-6 here (with 1e-8 a few gate_proj entries differ by ~1e-5).
    # DP=1 reference: the unsharded model, one AdamW step on the full batch (token mean over the batch).
    plain = load_hf_model(path)
    opt = build_optimizer(plain.parameters(), "adam", lr=1e-3, weight_decay=0.1, eps=1e-6)
    (_token_ce_sum(plain, tokens) / n_pred).backward()
    opt.step()

    # DP=2: each rank half the batch; FSDP averages gradients over 2 ranks, so scale the rank's sum by dp_size.
    local = tokens.chunk(state.dp_size)[state.dp_rank]
    scale = state.dp_size / n_pred
    model = _fsdp_adam_step(path, state, local, scale, offload=True)
    # Adam's step is nearly scale-invariant, so check the averaged gradients themselves (catches loss scaling).
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), plain.get_parameter(name).grad, atol=1e-6, rtol=1e-5)
    # offload/onload are no-ops on CPU: the same step without them is bit-identical
    no_offload = _full_params(_fsdp_adam_step(path, state, local, scale, offload=False))
    # activation recomputation (gradient checkpointing) under FSDP2 gives the same update
    recomputed = _full_params(_fsdp_adam_step(path, state, local, scale, offload=False, grad_ckpt=True))
    for n, p in recomputed.items():
        assert (p - no_offload[n]).abs().max().item() <= 1e-6, f"gradient checkpointing changed {n}"

    got = _full_params(model)
    assert all(torch.equal(got[n], no_offload[n]) for n in got), (
        "offload_to_cpu/load_to_device changed numbers"
    )
    for name, p in plain.named_parameters():
        diff = (got[name] - p.detach()).abs().max().item()
        assert diff <= 1e-5, f"{name}: DP=2 and DP=1 updates differ by {diff}"
    moved = max((got[n] - load_hf_model(path).get_parameter(n)).abs().max().item() for n in got)
    assert moved > 5e-4, "the optimizer step did not change the weights"
    dist.barrier()


def _deferred_sync_body(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.tensor import DTensor

    state = init_distributed("gloo", timeout_s=60)
    assert default_defer_gradient_sync(state.device, cpu_offload=False)
    assert not default_defer_gradient_sync(state.device, cpu_offload=True)
    # three micro-batches per rank, different on each rank
    micro_batches = _batch(seed=3 + rank, n=6).chunk(3)
    plain = load_hf_model(path)
    _token_ce_sum(plain, micro_batches[0]).backward()  # this rank's own gradient of its first micro-batch
    grads = {}
    for defer in (False, True):
        model = build_fsdp_model(path, state.fsdp_mesh)
        for i, tokens in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync_gradients_after(model, last, defer)
            _token_ce_sum(model, tokens).backward()
            if last or not defer:  # reduce-scattered into sharded gradients, parameters resharded
                done = all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())
                assert done, (defer, i)
            else:  # still gathered, holding this rank's own (not yet averaged) gradient
                for name, p in model.named_parameters():
                    assert not isinstance(p, DTensor), name
                    if i == 0:
                        own = plain.get_parameter(name).grad
                        torch.testing.assert_close(p.grad, own, atol=1e-6, rtol=1e-5)
        grads[defer] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, g in grads[False].items():  # the same gradients, summed in another order
        torch.testing.assert_close(grads[True][name], g, atol=1e-6, rtol=1e-5)
    dist.barrier()


def test_deferred_gradient_sync_reduces_once_per_step(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    run_distributed(_deferred_sync_body, 2, path, init_pg=False)


def _root_unit_body(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    state = init_distributed("gloo", timeout_s=60)
    assert not per_layer_units("cpu", cpu_offload=False, reshard_after_forward=False)
    assert per_layer_units("cpu", cpu_offload=False, reshard_after_forward=True)
    assert per_layer_units("cpu", cpu_offload=True, reshard_after_forward=False)
    assert per_layer_units("cuda", cpu_offload=False, reshard_after_forward=False)
    micro_batches = _batch(seed=11 + rank, n=4).chunk(2)  # two micro-batches per rank, different on each rank
    after: dict[bool, dict[str, torch.Tensor]] = {}
    for per_layer in (True, False):
        if per_layer:  # every rank loads the same weights and keeps its shards of them
            model = load_hf_model(path)
            apply_fsdp2(model, state.fsdp_mesh, torch.float32, torch.float32, False, False, per_layer=True)
        else:  # on CPU, build_fsdp_model makes the root the only unit
            model = build_fsdp_model(path, state.fsdp_mesh, reshard_after_forward=False)
        units = sum(isinstance(m, FSDPModule) for m in model.modules())
        assert units == (1 + model.config.num_hidden_layers if per_layer else 1), (per_layer, units)
        opt = build_optimizer(model.parameters(), lr=1e-2)
        for i, tokens in enumerate(micro_batches):
            sync_gradients_after(model, i == len(micro_batches) - 1, defer=True)
            _token_ce_sum(model, tokens).backward()
        clip_grad_norm_sharded(model.parameters(), 1.0)
        opt.step()
        after[per_layer] = _full_params(model)
    for name, p in after[True].items():  # shards are per parameter and an all-gather is a copy: bitwise equal
        assert torch.equal(after[False][name], p), name
    dist.barrier()


def test_cpu_root_only_unit_steps_like_per_layer_units(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    run_distributed(_root_unit_body, 2, path, init_pg=False)


def _sharded_clip_body(rank: int, world_size: int, path: str) -> None:
    state = init_distributed("gloo", timeout_s=60)
    tokens = _batch(seed=5 + rank, n=3)
    clipped = {}
    for mine in (False, True):
        model = build_fsdp_model(path, state.fsdp_mesh)
        _token_ce_sum(model, tokens).backward()
        for max_norm in (1e9, 0.5):  # no clipping, then clipping (the second call sees the unclipped grads)
            if mine:
                norm = clip_grad_norm_sharded(model.parameters(), max_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()
            clipped[mine, max_norm] = norm
        clipped[mine] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for max_norm in (1e9, 0.5):  # the DTensor path's arithmetic, so the same norm up to rounding
        torch.testing.assert_close(clipped[True, max_norm], clipped[False, max_norm], atol=0, rtol=1e-6)
    assert float(clipped[True, 1e9]) > 0.5, "the test gradient is too small to be clipped"
    for name, g in clipped[False].items():
        torch.testing.assert_close(clipped[True][name], g, atol=1e-7, rtol=1e-5)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped[True].values()]))
    torch.testing.assert_close(total, torch.tensor(0.5), atol=0, rtol=1e-5)
    # a non-finite gradient on one rank gives a non-finite norm on every rank
    model = build_fsdp_model(path, state.fsdp_mesh)
    _token_ce_sum(model, tokens).backward()
    if rank == 1:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
    assert not torch.isfinite(clip_grad_norm_sharded(model.parameters(), 1.0))
    # a plain module: torch's own clip
    plain = load_hf_model(path)
    _token_ce_sum(plain, tokens).backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    expected = torch.nn.utils.get_total_norm(grads)
    torch.testing.assert_close(clip_grad_norm_sharded(plain.parameters(), 1e9), expected)
    dist.barrier()


def test_sharded_grad_clip_equals_dtensor_clip(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    run_distributed(_sharded_clip_body, 2, path, init_pg=False)


def _metric_sum_body(rank: int, world_size: int) -> None:
    from miles.algo import metric
    from miles.backends.fsdp_utils.rollout_batch import MetricSum

    sums = MetricSum()
    sums.add({"loss": metric(2.0 + rank, 1.0 + rank)})
    sums.add_value("grad_norm", 3.0)
    # each key's largest value is on another rank; negative values too (the unused slots hold zeros)
    out = sums.reduce(None, maxima={"peak_a": 1.0 + rank, "peak_b": -1.0 - 3 * rank, "peak_c": 5.0 - rank})
    assert out == {
        "train/loss": 5.0 / 3.0,
        "train/grad_norm": 3.0,
        "peak_a": 2.0,
        "peak_b": -1.0,
        "peak_c": 5.0,
    }
    assert MetricSum().reduce(None) == {}  # nothing to reduce: still one (empty) collective on every rank
    dist.barrier()


def test_metric_sum_reduces_sums_and_maxima_in_one_collective() -> None:
    run_distributed(_metric_sum_body, 2)


def test_parallel_dims_validation() -> None:
    dims = ParallelDims(world_size=8, cp_size=2)
    assert dims.dp_size == 4 and dims.coords(5) == (2, 1)
    with pytest.raises(ValueError, match="context-parallel-size=3"):
        ParallelDims(world_size=8, cp_size=3)
    with pytest.raises(ValueError, match="cp-size|context-parallel-size=0"):
        ParallelDims(world_size=2, cp_size=0)
    with pytest.raises(ValueError, match="rank=8"):
        dims.coords(8)


def test_build_optimizer_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="--optimizer='lion'"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], "lion")


def test_sharded_logits_equal_unsharded(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    run_distributed(_sharded_logits_body, 2, path, init_pg=False)


def test_dp2_step_equals_dp1_step(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    run_distributed(_dp_step_body, 2, path, init_pg=False)


class _FakeEngines(http.server.ThreadingHTTPServer):
    """Engines at ``/<engine>/...``: a weight-update session (begin/end) around ``update_weights_from_tensor``, as
    SGLang demands, and ``/model_info`` reporting the last version; records every tensor it receives, per engine."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _EngineHandler)
        self.calls: dict[str, list[dict]] = collections.defaultdict(list)
        self.tensors: dict[str, list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
        self.in_session: set[str] = set()
        self.versions: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _EngineHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        engine, _, endpoint = self.path.strip("/").partition("/")
        assert endpoint == "model_info", self.path
        self._answer({"weight_version": self.server.versions.get(engine, "default")})

    def do_POST(self) -> None:
        engine, _, endpoint = self.path.strip("/").partition("/")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        answer = {"success": True, "message": ""}
        if engine == "hung" and endpoint == "update_weights_from_tensor":
            time.sleep(3)  # past the refit deadline of the updater that talks to it
        if engine == "bad" and endpoint == "update_weights_from_tensor":
            answer = {"success": False, "message": f"refused {self.path}"}
        elif endpoint == "begin_weight_update":
            self.server.in_session.add(engine)
        elif endpoint == "end_weight_update":
            self.server.in_session.discard(engine)
        elif endpoint != "update_weights_from_tensor" or engine not in self.server.in_session:
            answer = {"success": False, "message": f"refused {self.path} (outside a weight-update session)"}
        else:
            per_tp = [deserialize(s) for s in body["serialized_named_tensors"]]
            assert all([n for n, _ in tp] == [n for n, _ in per_tp[0]] for tp in per_tp)
            self.server.calls[engine].append({**body, "serialized_named_tensors": len(per_tp)})
            self.server.tensors[engine] += [(n, t.clone()) for n, t in per_tp[-1]]
            self.server.versions[engine] = body["weight_version"]
        self._answer(answer)

    def _answer(self, answer: dict) -> None:
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _refit_body(rank: int, world_size: int, path: str, url: str) -> None:
    state = init_distributed("gloo", timeout_s=60)
    model = build_fsdp_model(path, state.fsdp_mesh)
    bucket_bytes = 8192
    expected = plan_weight_buckets(model, bucket_bytes)
    # every rank gathers the same full tensors, whatever its shard
    for names, bucket in zip(expected, iter_weight_buckets(model, bucket_bytes), strict=True):
        assert [n for n, _ in bucket] == names
        assert sum(t.numel() * 4 for _, t in bucket) <= bucket_bytes or len(bucket) == 1

    one_per_rank = ColocatedWeightUpdater(
        RefitSetup([f"{url}/e0", f"{url}/e1"], 1, rank, world_size, api_key="k")
    )
    assert one_per_rank.update(model, bucket_bytes, weight_version="v1") == len(expected)
    tp2 = ColocatedWeightUpdater(RefitSetup([f"{url}/e2"], 2, rank, world_size, timeout_s=30))
    assert tp2.update(model, bucket_bytes, weight_version="v2") == len(expected)

    bad = ColocatedWeightUpdater(RefitSetup([f"{url}/bad"], 2, rank, world_size))
    with pytest.raises(
        RuntimeError,
        match=r"engine .*/bad, update_weights_from_tensor, refit v3, bucket 0, phase response: success=false",
    ):
        bad.update(model, bucket_bytes, weight_version="v3")
    hung = ColocatedWeightUpdater(RefitSetup([f"{url}/hung"], 2, rank, world_size, timeout_s=0.5))
    with pytest.raises(  # the refit deadline names the engine, the call, the refit and the bucket
        RuntimeError,
        match=r"engine .*/hung, update_weights_from_tensor, refit v4, bucket 0, phase request: ReadTimeout",
    ):
        hung.update(model, bucket_bytes, weight_version="v4")
    with pytest.raises(ValueError, match="at most 1 engines"):
        ColocatedWeightUpdater(RefitSetup([f"{url}/e0", f"{url}/e1"], 2, rank, world_size))


def test_bucketed_refit_to_colocated_engines(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    hf = load_file(f"{path}/model.safetensors")
    server = _FakeEngines()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        run_distributed(_refit_body, 2, path, server.url, init_pg=False)
    finally:
        server.shutdown()
    for engine, tp_size, version in [("e0", 1, "v1"), ("e1", 1, "v1"), ("e2", 2, "v2")]:
        calls, received = server.calls[engine], server.tensors[engine]
        assert sorted(n for n, _ in received) == sorted(hf), engine  # every tensor exactly once
        for name, t in received:
            assert torch.equal(t, hf[name]), f"{engine}: {name}"
        assert [c["flush_cache"] for c in calls] == [False] * (len(calls) - 1) + [True]
        assert {c["weight_version"] for c in calls} == {version}
        assert {c["serialized_named_tensors"] for c in calls} == {tp_size}
        assert all(c["load_format"] is None for c in calls)
    assert "bad" not in server.calls


def _fake_distributed_engine(port: int, out: str, ready) -> None:
    """An engine process: joins the update group on request and records what rank 0 broadcasts; like SGLang it
    takes updates only inside a begin/end weight-update session and reports its version on ``/model_info``."""
    torch.set_num_threads(1)
    seen: dict = {"group": None, "tensors": [], "calls": [], "session": False, "version": "default"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            assert self.path.strip("/") == "model_info", self.path
            data = json.dumps({"weight_version": seen["version"]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            endpoint = self.path.strip("/")
            ok = True
            if endpoint in ("begin_weight_update", "end_weight_update"):
                seen["session"] = endpoint == "begin_weight_update"
            elif endpoint == "update_weights_from_distributed" and not seen["session"]:
                ok = False
            elif endpoint == "init_weights_update_group":
                seen["init"] = body
                seen["group"] = init_side_group(
                    body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
                    body["group_name"], body["backend"], timeout_s=60,
                )  # fmt: skip
            elif endpoint == "update_weights_from_distributed":
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                    t = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(t, group=seen["group"], group_src=0)
                    seen["tensors"].append((name, t))
                seen["calls"].append({k: body[k] for k in ("flush_cache", "weight_version", "group_name")})
                seen["version"] = body["weight_version"]
            elif endpoint == "destroy_weights_update_group":
                dist.destroy_process_group(seen["group"])
                torch.save({k: seen[k] for k in ("tensors", "calls", "init")}, out)
            data = json.dumps(
                {"success": ok, "message": "" if ok else "outside a weight-update session"}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
            if endpoint == "destroy_weights_update_group":  # stop only once the answer is out
                threading.Thread(target=self.server.shutdown).start()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ready.set()
    server.serve_forever()


def _distributed_refit_body(rank: int, world_size: int, path: str, url: str, master_port: int) -> None:
    state = init_distributed("gloo", timeout_s=60)
    model = build_fsdp_model(path, state.fsdp_mesh)
    updater = DistributedWeightUpdater(
        RefitSetup([url], 1, rank, world_size, timeout_s=60), "127.0.0.1", master_port
    )
    updater.connect()
    n = updater.update(model, 8192, weight_version="v7")
    assert n == len(plan_weight_buckets(model, 8192))
    updater.disconnect()


def test_distributed_refit_broadcasts_every_tensor(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    hf = load_file(f"{path}/model.safetensors")
    ctx = torch.multiprocessing.get_context("spawn")
    ready, port, out = ctx.Event(), free_port(), str(tmp_path / "engine.pt")
    engine = ctx.Process(target=_fake_distributed_engine, args=(port, out, ready), daemon=True)
    engine.start()
    try:
        assert ready.wait(60), "fake engine did not start"
        run_distributed(
            _distributed_refit_body, 2, path, f"http://127.0.0.1:{port}", free_port(), init_pg=False
        )
        engine.join(30)
    finally:
        if engine.is_alive():
            engine.kill()
    got = torch.load(out)
    assert got["init"]["rank_offset"] == 1 and got["init"]["world_size"] == 2
    names = [n for n, _ in got["tensors"]]
    assert sorted(names) == sorted(hf) and len(names) == len(set(names))
    for name, t in got["tensors"]:
        assert torch.equal(t, hf[name]), name
    calls = got["calls"]
    assert [c["flush_cache"] for c in calls] == [False] * (len(calls) - 1) + [True]
    assert {c["weight_version"] for c in calls} == {"v7"}


def _gpu_offload_body(rank: int, world_size: int, path: str) -> None:
    state = init_distributed("nccl", timeout_s=120)
    tokens = _batch(n=2).to(state.device)

    def run(offload: bool) -> dict[str, torch.Tensor]:
        model = build_fsdp_model(
            path, state.fsdp_mesh, torch.float32, torch.float32, False, device=state.device
        )
        opt = build_optimizer(model.parameters(), "adam", lr=1e-3)
        for _ in range(2):
            _token_ce_sum(model, tokens).backward()
            opt.step()
            if offload:
                before = torch.cuda.memory_allocated()
                offload_to_cpu(model, opt)
                assert all(p.device.type == "cpu" for p in model.parameters())
                assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values() if v.dim())
                assert torch.cuda.memory_allocated() < before
                load_to_device(model, opt, state.device)
                assert all(p.device == state.device for p in model.parameters())
            opt.zero_grad(set_to_none=True)
        return _full_params(model)

    with_offload, without = run(True), run(False)
    assert all(torch.equal(with_offload[n], without[n]) for n in without)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_offload_roundtrip_keeps_training_identical(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    run_distributed(_gpu_offload_body, 1, path, init_pg=False)
