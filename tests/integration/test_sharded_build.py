"""`build_fsdp_model` materialises the model sharded, on 2 gloo CPU ranks: every parameter is on the meta device
when it is sharded, no rank's memory ever grows by the full model (peak RSS growth measured while it builds), and
the shards hold `from_pretrained`'s values bitwise, buffers included; a checkpoint that is not read tensor by tensor
(the from_pretrained fallback) gives the same values."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from _util import run_distributed

from miles.backends.fsdp_utils import hf_load
from miles.backends.fsdp_utils import model as model_mod

# ~27M parameters (109 MB in fp32), no tensor above 3.2 MB: a full copy stands out from one rank's half
SHAPE = dict(vocab_size=2048, hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536)


def _save_model(path: str) -> int:
    """Save the model in bfloat16, as HF checkpoints are: the fp32 master weights are a cast, so loading the whole
    model would allocate all of it (an fp32 checkpoint can be memory-mapped instead). Returns its fp32 bytes."""
    from miles.tools.tiny_model import tiny_config, tiny_model

    cfg = tiny_config(max_position_embeddings=256, tie_word_embeddings=False, **SHAPE)
    model = tiny_model(cfg, seed=0)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(path)
    return full_bytes


def rss_anon() -> int:
    """This process's resident anonymous memory in bytes (heap and anonymous mappings: what tensors take; a
    memory-mapped checkpoint's pages are file-backed and not counted)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """The largest `rss_anon` seen, sampled every millisecond on a thread, from `start` to `stop`."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self.base = rss_anon()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _build_body(rank: int, world_size: int, path: str, full_bytes: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    hf_load.load_hf_model(path, on_meta=True)  # imports the model's code before the baseline
    sharded_while_real: list[int] = []
    real_fully_shard = model_mod.fully_shard

    def watching_fully_shard(module, **kwargs):
        sharded_while_real.append(
            sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)
        )
        return real_fully_shard(module, **kwargs)

    model_mod.fully_shard = watching_fully_shard
    try:
        with PeakSampler() as peak:
            model = model_mod.build_fsdp_model(path, mesh)
    finally:
        model_mod.fully_shard = real_fully_shard
    assert len(sharded_while_real) == SHAPE["num_layers"] + 1 or len(sharded_while_real) == 1, (
        sharded_while_real
    )
    assert set(sharded_while_real) == {0}, (
        f"rank {rank}: parameters materialised before sharding: {sharded_while_real}"
    )
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert abs(local - full_bytes / world_size) < 0.02 * full_bytes, (local, full_bytes)
    # the shards plus one tensor at a time; a full copy on the rank would be >= full_bytes
    assert peak.growth < 0.75 * full_bytes, (
        f"rank {rank}: memory grew {peak.growth / 1e6:.1f} MB while building"
    )
    print(f"rank {rank}: peak RSS growth {peak.growth / 1e6:.1f} MB, shards {local / 1e6:.1f} MB, "
          f"model {full_bytes / 1e6:.1f} MB", flush=True)  # fmt: skip
    _same_as_from_pretrained(model, path)


def _same_as_from_pretrained(model: torch.nn.Module, path: str) -> None:
    """Every parameter (gathered) and buffer equals `from_pretrained`'s bitwise."""
    plain = hf_load.load_hf_model(path)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), plain.get_parameter(name), atol=0, rtol=0, msg=name)
    buffers = dict(plain.named_buffers())
    assert buffers, "the model has rotary buffers"
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name], atol=0, rtol=0, msg=name)


@pytest.mark.slow
def test_no_rank_materialises_the_full_model_and_values_are_bitwise(tmp_path):
    path = str(tmp_path / "model")
    full_bytes = _save_model(path)
    run_distributed(_build_body, 2, path, full_bytes, timeout_s=300)


def _fallback_body(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    hf_load.safetensors_shapes = lambda _path: None  # as for .bin weights: rank 0 loads whole, in host memory
    model = model_mod.build_fsdp_model(path, mesh, transform=model_mod.attach_value_head)
    plain = hf_load.load_hf_model(path)
    for name, p in model.named_parameters():
        if name.startswith("lm_head."):  # the value head starts at zero, on every rank
            assert p.full_tensor().abs().max().item() == 0.0, name
            continue
        torch.testing.assert_close(p.full_tensor(), plain.get_parameter(name), atol=0, rtol=0, msg=name)
    assert dist.get_world_size() == 2


def test_the_from_pretrained_fallback_gives_the_same_values_and_transforms_get_their_initial_values(tmp_path):
    from _util import save_tiny_qwen3

    path = save_tiny_qwen3(str(tmp_path / "tiny"), tie_word_embeddings=False)
    run_distributed(_fallback_body, 2, path)


def test_a_transform_that_adds_parameters_without_initial_values_is_refused():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    known = {id(p) for p in net.parameters()}
    net.append(torch.nn.Linear(2, 1))
    with pytest.raises(
        ValueError, match=r"added parameters \['weight', 'bias'\] to 1 \(Linear\) without initial"
    ):
        hf_load._transform_initial_values(net, known)
    net[1] = model_mod.ValueHead(2)
    values = hf_load._transform_initial_values(net, known)
    assert sorted(values) == ["1.bias", "1.weight"] and all(v.abs().sum() == 0 for v in values.values())


def _local_reads_body(rank: int, world_size: int, path: str, other_host: bool) -> None:
    """Ranks on one host read their own rows (no checkpoint tensor is broadcast); a rank on another host makes
    every rank take rank 0's broadcast. The values are `from_pretrained`'s bitwise either way."""
    import socket

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    if other_host and rank == 1:
        socket.gethostname = lambda: "another-host"
    sent: list[int] = []
    real_broadcast = dist.broadcast

    def counting_broadcast(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)

    dist.broadcast = counting_broadcast
    try:
        model = model_mod.build_fsdp_model(path, mesh, transform=model_mod.attach_value_head)
    finally:
        dist.broadcast = real_broadcast
    plain = hf_load.load_hf_model(path)
    checkpoint = sum(p.numel() for n, p in plain.named_parameters() if not n.startswith("lm_head."))
    head = sum(p.numel() for n, p in model.named_parameters() if n.startswith("lm_head."))
    buffers = sum(b.numel() for b in model.buffers())
    if other_host:
        assert sum(sent) >= checkpoint, (sum(sent), checkpoint)
    else:  # only the value head (rank 0's initial values) and the buffers
        assert sum(sent) == head + buffers, (sum(sent), head, buffers)
    for name, p in model.named_parameters():
        if name.startswith("lm_head."):
            assert p.full_tensor().abs().max().item() == 0.0, name
            continue
        torch.testing.assert_close(p.full_tensor(), plain.get_parameter(name), atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("other_host", [False, True])
def test_ranks_on_one_host_read_their_own_rows_of_the_checkpoint(tmp_path, other_host):
    from _util import save_tiny_qwen3

    path = save_tiny_qwen3(str(tmp_path / "tiny"), tie_word_embeddings=False)
    run_distributed(_local_reads_body, 2, path, other_host)
