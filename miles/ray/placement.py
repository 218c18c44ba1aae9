"""Placement groups for training actors and rollout engines.

One bundle per worker. With GPUs a bundle is {GPU: 1, CPU: 1}; without, it is {CPU: 1} and the `--*-num-gpus*`
flags count CPU worker processes. Colocated mode shares one set of bundles between the training actors and the
engines (each takes a fraction of the bundle); disaggregated mode gives the engines bundles of their own after the
training ones.

Ray does not promise that bundle i holds GPU i, nor that the bundles of one node come together. With GPUs,
`create_placement` therefore asks each bundle once where it landed (a tiny task per bundle reports its node and
Ray's GPU id), sorts the bundles by (node, GPU id) and hands them out in that order: training rank r gets the r-th
bundle, engine e the bundles of ranks e*tp .. e*tp+tp-1 of the engine side (`engine_gpu_plan`). Each engine then
checks at start that the GPUs it launches on are the planned ones (`check_engine_gpus`). The placement math below is
plain Python (ray is imported only where a placement group is made), so it is tested without Ray.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


class PlacementError(RuntimeError):
    """The GPUs of an engine or training rank are not the ones it was planned to get (or overlap another's)."""


# Fractions of a shared bundle in colocated mode: both fit in one bundle at once.
COLOCATED_ACTOR_SHARE = 0.4
COLOCATED_ENGINE_SHARE = 0.2
# The critic (--advantage-estimator ppo) shares the training bundles: colocated it takes what is left of a
# bundle; disaggregated, actor and critic split the training bundles in half.
COLOCATED_CRITIC_SHARE = 0.4
DISAGGREGATED_TRAIN_SHARE_WITH_CRITIC = 0.5
# What the one-off probe of a bundle takes of it (it ends before anything else is placed there).
PROBE_SHARE = 0.01


@dataclass(frozen=True)
class BundleLocation:
    """Where one placement-group bundle landed: its node (IP and Ray node id) and its GPU, as Ray names it
    (`ray.get_gpu_ids()` in a task on the bundle, as a string: an index, or a UUID where CUDA_VISIBLE_DEVICES held
    UUIDs when Ray started). Ray's GPU ids are the values CUDA_VISIBLE_DEVICES takes on that node."""

    node_ip: str
    node_id: str
    gpu_id: str

    def __str__(self) -> str:
        return f"{self.node_ip} GPU {self.gpu_id}"


def _ip_key(ip: str) -> tuple[int, int | str]:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def _gpu_key(gpu_id: str) -> tuple[int, int | str]:
    return (0, int(gpu_id)) if gpu_id.isdigit() else (1, gpu_id)


def bundle_order(locations: Sequence[BundleLocation]) -> list[int]:
    """Bundle indices sorted by (node IP, node id, GPU id): GPU ids numerically, IPs as addresses (10.0.0.9 before
    10.0.0.10); the node id only separates nodes that share an IP (several raylets on one host)."""
    return sorted(
        range(len(locations)),
        key=lambda b: (_ip_key(locations[b].node_ip), locations[b].node_id, _gpu_key(locations[b].gpu_id)),
    )


def assign_bundles(
    order: Sequence[int], num_actor_workers: int, num_rollout_workers: int, colocate: bool
) -> tuple[list[int], list[int]]:
    """(bundle of training rank r, bundle of rollout worker j) from the sorted bundle order: training ranks take
    the first bundles; engines take the same ones (colocated) or the ones after them (disaggregated)."""
    actor = list(order[:num_actor_workers])
    start = 0 if colocate else num_actor_workers
    return actor, list(order[start : start + num_rollout_workers])


@dataclass(frozen=True)
class EngineGPUs:
    """The GPUs planned for one engine: its bundles in TP-rank order, their node and Ray GPU ids (TP rank k runs on
    `gpu_ids[k]`). The engine's actor sits on `bundles[0]`."""

    engine_index: int
    bundles: tuple[int, ...]
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...]

    def describe(self) -> str:
        return f"engine {self.engine_index} (bundles {list(self.bundles)} on {self.node_ip})"


def engine_gpu_plan(
    locations: Sequence[BundleLocation],
    engine_bundles: Sequence[int],
    actor_bundles: Sequence[int],
    gpus_per_engine: int,
    colocate: bool,
) -> list[EngineGPUs]:
    """The GPUs of each engine (engine e: rollout workers e*tp .. e*tp+tp-1), checked: an engine's bundles are on
    one node (an SGLang engine runs its TP ranks on one node), no GPU belongs to two engines, and colocated, engine
    e's TP rank k is on the GPU of training rank e*tp+k (the rank whose weights it receives over CUDA IPC).
    Raises PlacementError naming the engine, its bundles and the GPUs."""
    if gpus_per_engine < 1 or len(engine_bundles) % gpus_per_engine:
        raise ValueError(
            f"--rollout-num-gpus-per-engine {gpus_per_engine} must divide the {len(engine_bundles)} engine bundles"
        )
    plan: list[EngineGPUs] = []
    owner: dict[tuple[str, str], int] = {}
    for e in range(len(engine_bundles) // gpus_per_engine):
        bundles = tuple(engine_bundles[e * gpus_per_engine : (e + 1) * gpus_per_engine])
        where = [locations[b] for b in bundles]
        nodes = sorted({loc.node_ip + "/" + loc.node_id[:8] for loc in where})
        if len(nodes) > 1:
            raise PlacementError(
                f"engine {e}: its {gpus_per_engine} GPUs (bundles {list(bundles)}: {[str(w) for w in where]}) span "
                f"nodes {nodes}; an engine's GPUs must be on one node: make --rollout-num-gpus-per-engine divide "
                f"the GPUs per node (and, disaggregated, the training GPUs)"
            )
        for b, loc in zip(bundles, where, strict=True):
            other = owner.get((loc.node_id, loc.gpu_id))
            owner[(loc.node_id, loc.gpu_id)] = e
            if other is not None:
                raise PlacementError(
                    f"engine {e} (bundle {b}) and engine {other} both got {loc}: one GPU given twice"
                )
        if colocate and actor_bundles:  # (a rollout-only run has no training ranks)
            ranks = range(e * gpus_per_engine, (e + 1) * gpus_per_engine)
            trainer = [locations[actor_bundles[r]] for r in ranks if r < len(actor_bundles)]
            if trainer != where:
                raise PlacementError(
                    f"engine {e} (bundles {list(bundles)}) is on {[str(w) for w in where]} but its training ranks "
                    f"{list(ranks)} are on {[str(t) for t in trainer]}: colocated, they must share GPUs"
                )
        plan.append(
            EngineGPUs(e, bundles, where[0].node_ip, where[0].node_id, tuple(w.gpu_id for w in where))
        )
    return plan


def _visible(cuda_visible_devices: str | None) -> list[str] | None:
    """The devices a process sees, by CUDA_VISIBLE_DEVICES value; None when unset (every device, by index)."""
    if cuda_visible_devices is None:
        return None
    return [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]


def sglang_launch_gpus(
    cuda_visible_devices: str | None, base_gpu_id: int, gpu_id_step: int, tp_size: int
) -> list[str]:
    """The GPUs an SGLang server's TP ranks run on, by CUDA_VISIBLE_DEVICES value: SGLang 0.5.23 puts TP rank k on
    device `base_gpu_id + k * gpu_id_step` of the devices the server sees (an index into its
    CUDA_VISIBLE_DEVICES when that is set, the device index otherwise); PlacementError when that runs past them."""
    visible = _visible(cuda_visible_devices)
    indices = [base_gpu_id + k * gpu_id_step for k in range(tp_size)]
    if visible is None:
        return [str(i) for i in indices]
    if indices[-1] >= len(visible) or indices[0] < 0:
        raise PlacementError(
            f"base_gpu_id {base_gpu_id} with gpu_id_step {gpu_id_step} and tp {tp_size} needs visible devices "
            f"{indices}, but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} shows {len(visible)}"
        )
    return [visible[i] for i in indices]


def check_engine_gpus(
    planned: EngineGPUs,
    kind: str,
    sglang_args: Mapping[str, object],
    ray_gpu_ids: Sequence[object],
    node_id: str,
    cuda_visible_devices: str | None,
) -> tuple[dict[str, str], list[str]]:
    """Check, at an engine's start, that it runs on the GPUs it was planned; returns the server's environment
    additions and the GPUs (Ray's ids) its TP ranks will run on, as launched.

    - Ray gave the engine's actor the GPU of its first bundle, on its node (`ray_gpu_ids`, `node_id`), and the
      actor's own CUDA_VISIBLE_DEVICES (set by Ray, or inherited from the node) shows it;
    - an SGLang server sees exactly the engine's GPUs, in TP-rank order (CUDA_VISIBLE_DEVICES set to them) and
      starts at the first (`base_gpu_id` 0, set unless `--sglang-base-gpu-id` was given): the GPUs as launched,
      devices base_gpu_id .. base_gpu_id+tp-1 of what it sees, must be the planned ones (a `--sglang-base-gpu-id`
      or `--sglang-gpu-id-step` that moves them fails here);
    - the embedded engine (one GPU) sees only its planned GPU and runs on device 0.
    Raises PlacementError naming the engine, its bundles, the expected and the actual GPU ids."""
    expected = list(planned.gpu_ids)
    ray_ids = [str(g) for g in ray_gpu_ids]
    if node_id != planned.node_id or ray_ids != expected[:1]:
        raise PlacementError(
            f"{planned.describe()}: expected GPUs {expected}; Ray gave its actor (on bundle {planned.bundles[0]}) "
            f"GPU(s) {ray_ids} on node {node_id[:8]}, expected {expected[:1]} on node {planned.node_id[:8]}"
        )
    visible = _visible(cuda_visible_devices)
    if visible is not None and expected[0] not in visible:
        raise PlacementError(
            f"{planned.describe()}: expected GPUs {expected}; Ray gave its actor GPU {expected[0]}, but the "
            f"actor's CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} does not show it"
        )
    env = {"CUDA_VISIBLE_DEVICES": ",".join(expected)}
    if kind != "sglang":
        if len(expected) != 1:
            raise PlacementError(f"{planned.describe()}: the embedded engine runs on one GPU, got {expected}")
        return env, list(expected)
    base, step = sglang_int_arg(sglang_args, "base_gpu_id", 0), sglang_int_arg(sglang_args, "gpu_id_step", 1)
    try:
        launched = sglang_launch_gpus(env["CUDA_VISIBLE_DEVICES"], base, step, len(expected))
    except PlacementError as e:
        raise PlacementError(f"{planned.describe()}: expected GPUs {expected}: {e}") from None
    if launched != expected:
        raise PlacementError(
            f"{planned.describe()}: expected GPUs {expected}, the server would run on {launched} "
            f"(--sglang-base-gpu-id {base}, --sglang-gpu-id-step {step}: leave them to the placement)"
        )
    return env, launched


def sglang_int_arg(sglang_args: Mapping[str, object], name: str, default: int) -> int:
    """An integer SGLang server flag from `--sglang-*` values (keyed `base_gpu_id` or `base-gpu-id`)."""
    for key in (name, name.replace("_", "-")):
        if key in sglang_args:
            return int(str(sglang_args[key]))
    return default


@dataclass(frozen=True)
class Placement:
    pg: PlacementGroup
    use_gpu: bool
    # bundle index of training rank r, and of rollout worker j (one engine spans num_gpus_per_engine of them),
    # in the bundles' sorted (node, GPU id) order
    actor_bundles: list[int]
    engine_bundles: list[int]
    colocate: bool
    has_critic: bool = False  # a critic train group shares the training bundles
    # where each bundle landed (by bundle index); None on CPU
    locations: tuple[BundleLocation, ...] | None = None

    def actor_options(self, rank: int) -> dict:
        return self.worker_options("actor", rank)

    def worker_options(self, role: str, rank: int) -> dict:
        """Ray options of training rank `rank` of train group `role` ("actor" or "critic")."""
        if role not in ("actor", "critic") or (role == "critic" and not self.has_critic):
            raise ValueError(f"no {role!r} train group in this placement (has_critic={self.has_critic})")
        if self.colocate:
            share = COLOCATED_ACTOR_SHARE if role == "actor" else COLOCATED_CRITIC_SHARE
        else:
            share = DISAGGREGATED_TRAIN_SHARE_WITH_CRITIC if self.has_critic else 1.0
        return self._options(self.actor_bundles[rank], share)

    def engine_options(self, engine_index: int, gpus_per_engine: int) -> dict:
        share = COLOCATED_ENGINE_SHARE if self.colocate else 1.0
        return self._options(self.engine_bundles[engine_index * gpus_per_engine], share)

    def engine_gpus(self, gpus_per_engine: int) -> list[EngineGPUs] | None:
        """Each engine's planned GPUs, checked (`engine_gpu_plan`); None without GPUs."""
        if self.locations is None:
            return None
        return engine_gpu_plan(
            self.locations, self.engine_bundles, self.actor_bundles, gpus_per_engine, self.colocate
        )

    def actor_gpu(self, rank: int) -> BundleLocation | None:
        """Where training rank `rank` runs; None without GPUs."""
        return None if self.locations is None else self.locations[self.actor_bundles[rank]]

    def _options(self, bundle: int, share: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle
        )
        if self.use_gpu:
            return {"num_gpus": share, "num_cpus": share, "scheduling_strategy": strategy}
        return {"num_cpus": share, "scheduling_strategy": strategy}


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def _where_am_i() -> tuple[str, str, list[str]]:
    import ray

    return (
        ray.util.get_node_ip_address(),
        ray.get_runtime_context().get_node_id(),
        [str(g) for g in ray.get_gpu_ids()],
    )


def probe_bundles(pg: PlacementGroup, num_bundles: int, timeout_s: float) -> list[BundleLocation]:
    """Where each GPU bundle of `pg` landed: one tiny task per bundle reports its node and Ray's GPU id."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles.ray.utils import ray_get

    # it touches no GPU: one worker may answer several probes (Ray's default for a GPU task is one call a worker)
    task = ray.remote(max_calls=0)(_where_am_i)
    refs = [
        task.options(
            num_cpus=0,
            num_gpus=PROBE_SHARE,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=b
            ),
        ).remote()
        for b in range(num_bundles)
    ]
    answers = ray_get(refs, timeout_s, phase=f"asking {num_bundles} placement-group bundles for their GPU")
    locations = []
    for b, (ip, node_id, gpus) in enumerate(answers):
        if len(gpus) != 1:
            raise PlacementError(f"bundle {b} on {ip}: expected one GPU, Ray reports {gpus}")
        locations.append(BundleLocation(ip, node_id, gpus[0]))
    return locations


def create_placement(
    num_actor_workers: int,
    num_rollout_workers: int,
    colocate: bool,
    use_gpu: bool,
    timeout_s: float = 300.0,
    has_critic: bool = False,
) -> Placement:
    """Reserve bundles for `num_actor_workers` training ranks and `num_rollout_workers` engine workers (either may
    be 0 for replay debugging: a trainer without engines, or engines without a trainer). With GPUs the bundles are
    handed out sorted by (node, GPU id) (`probe_bundles`, `bundle_order`)."""
    from ray.util.placement_group import placement_group

    from miles.ray.utils import ray_get

    if min(num_actor_workers, num_rollout_workers) < 0 or num_actor_workers + num_rollout_workers < 1:
        raise ValueError(
            f"need training or rollout workers, got {num_actor_workers} and {num_rollout_workers}"
        )
    if colocate and num_actor_workers and num_rollout_workers > num_actor_workers:
        raise ValueError(
            f"--colocate shares bundles, so --rollout-num-gpus ({num_rollout_workers}) cannot exceed the "
            f"training workers ({num_actor_workers})"
        )
    total = (
        max(num_actor_workers, num_rollout_workers) if colocate else num_actor_workers + num_rollout_workers
    )
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(total)], strategy="PACK")
    ray_get(pg.ready(), timeout_s, phase=f"reserving {total} placement-group bundles of {bundle}")
    locations = probe_bundles(pg, total, timeout_s) if use_gpu else None
    order = bundle_order(locations) if locations is not None else list(range(total))
    actor_bundles, engine_bundles = assign_bundles(order, num_actor_workers, num_rollout_workers, colocate)
    return Placement(
        pg,
        use_gpu,
        actor_bundles,
        engine_bundles,
        colocate,
        has_critic,
        tuple(locations) if locations is not None else None,
    )
