"""Resource pools and actors: where `ray.remote` is applied to the plain worker classes.

The rollout pool and the trainer pool are two placement groups, so their resources are disjoint by
construction (fractional CPUs on a laptop, whole GPUs on a cluster; counts from `recipe.resources`).
The buffer and the verifiers take no reserved resources: they are light and must never wait for a
bundle (zrl.runtime_env.light_actor). Every actor gets the project's environment variables (vLLM in-process engine, compile caches,
offline wandb/hub) explicitly, so the same code works embedded and under `ray job submit`.
"""

import logging
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zrl.config.schema import Resources
from zrl.runtime_env import actor_env

log = logging.getLogger("zrl")

@dataclass
class Pool:
    group: object  # ray PlacementGroup
    cpus: float
    gpus: float
    size: int
    actors: list = field(default_factory=list)
    one_machine: bool = False  # the cluster is one node: process groups listen on loopback only

    def options(self, index: int, **extra) -> dict:
        env = actor_env(self.cpus)
        if self.one_machine:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's connections (trainer group, weight sync) on loopback
        return dict(num_cpus=self.cpus, num_gpus=self.gpus, runtime_env={"env_vars": env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
                    **extra)

    def actor(self, cls, index: int, *args, max_restarts: int = 0, **kwargs):
        """An actor of the plain class `cls` in bundle `index`: Ray restarts it up to `max_restarts`
        times and never retries its calls."""
        options = self.options(index, max_restarts=max_restarts, max_task_retries=0)
        return ray.remote(cls).options(**options).remote(*args, **kwargs)


def one_machine() -> bool:
    """Whether the Ray cluster is a single node (the embedded default)."""
    return sum(1 for node in ray.nodes() if node["Alive"]) == 1


def reserve_pool(name: str, size: int, cpus: float, gpus: float, timeout_s: float = 120.0) -> Pool:
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle] * size, strategy="PACK", name=f"zrl-{name}")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"could not reserve the {name} pool ({size} x {bundle}) within {timeout_s:.0f} s; "
                           f"cluster resources: {ray.cluster_resources()}")
    return Pool(group, cpus, gpus, size, one_machine=one_machine())


def reserve_pools(resources: Resources) -> tuple[Pool, Pool]:
    r = resources
    rollout = reserve_pool("rollout", r.rollout_workers, r.cpus_per_rollout_worker, r.gpus_per_rollout_worker)
    trainer = reserve_pool("trainer", r.trainer_workers, r.cpus_per_trainer_worker, r.gpus_per_trainer_worker)
    log.info("pools reserved: %d rollout worker(s) x %g CPU/%g GPU, %d trainer rank(s) x %g CPU/%g GPU",
             r.rollout_workers, r.cpus_per_rollout_worker, r.gpus_per_rollout_worker,
             r.trainer_workers, r.cpus_per_trainer_worker, r.gpus_per_trainer_worker)
    return rollout, trainer


def release(pool: Pool) -> None:
    for actor in pool.actors:
        ray.kill(actor)
    pool.actors = []
    remove_placement_group(pool.group)
