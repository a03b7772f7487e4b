"""A weight-sync rig for the tests and bench/weight_sync.py: FSDP2 trainer ranks and rollout workers as
Ray actors, joined by the real sync paths (collective group or object store) that the RL stage uses."""

import time

import numpy as np
import ray

from zrl.pipeline.rollout_worker import RolloutWorker
from zrl.pipeline.trainer_rank import TrainerRank


class ProbeWorker(RolloutWorker):
    """A rollout worker that can also sample fixed prompts with fixed seeds (to compare engines)."""

    def sample(self, prompts: list[list[int]], seed: int, max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
        from serving.engine import SamplingConfig

        groups = self.engine.generate(prompts, 1, SamplingConfig(max_tokens=max_tokens, seed=seed))
        return [(g[0].token_ids.tolist(), g[0].logprobs.tolist()) for g in groups]


def start_trainers(pool, model_path, settings) -> list:
    from zrl.trainer import Rendezvous

    ranks = [ray.remote(TrainerRank).options(**pool.options(i)).remote() for i in range(pool.size)]
    host, port = ray.get(ranks[0].address.remote("127.0.0.1"))
    ray.get([r.start.remote(Rendezvous(host, port, i, pool.size), str(model_path), settings)
             for i, r in enumerate(ranks)])
    return ranks


def start_workers(pool, model_path, stage, count: int, dtype: str = "float32") -> list:
    actor = ray.remote(ProbeWorker)
    return [actor.options(**pool.options(i)).remote(i, str(model_path), stage, 0, dtype) for i in range(count)]


def form_group(ranks, workers, timeout_s: float = 120.0):
    address = ray.get(ranks[0].listen_for_sync.remote("127.0.0.1", len(workers), "gloo", timeout_s))
    ray.get([ranks[0].join_sync.remote(address)] + [w.join_sync.remote(address, i + 1) for i, w in enumerate(workers)])
    return address


def sync_collective(ranks, workers, dtype: str, bucket_bytes: int) -> dict:
    """One streamed sync; seconds are wall time from the calls to the last member's return."""
    started = time.perf_counter()
    sent = [r.sync_weights.remote(dtype, bucket_bytes) for r in ranks]
    received = ray.get([w.receive_weights.remote() for w in workers])
    sent = ray.get(sent)
    return {"seconds": time.perf_counter() - started, "bytes": sent[0].num_bytes, "version": sent[0].version,
            "sender_peak": sent[0].peak_extra_bytes, "receiver_peak": max(r.peak_extra_bytes for r in received),
            "versions": [r.policy_version for r in received]}


def sync_object_store(ranks, workers, dtype: str, version: int) -> dict:
    """The fallback path: rank 0's whole state dict through Ray's object store."""
    started = time.perf_counter()
    exports = [r.export_state.remote(dtype) for r in ranks]
    received = ray.get([w.update_weights.remote(exports[0], version) for w in workers])
    ray.get(exports[1:])
    return {"seconds": time.perf_counter() - started, "bytes": received[0].num_bytes,
            "receiver_peak": max(r.peak_extra_bytes for r in received)}


def max_abs_diff(a, b) -> float:
    """Largest |logprob difference| of two `ProbeWorker.sample` results that sampled the same tokens."""
    worst = 0.0
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(a, b, strict=True):
        assert tokens_a == tokens_b, f"the engines sampled different tokens: {tokens_a} vs {tokens_b}"
        worst = max(worst, float(np.max(np.abs(np.asarray(lp_a) - np.asarray(lp_b)), initial=0.0)))
    return worst
