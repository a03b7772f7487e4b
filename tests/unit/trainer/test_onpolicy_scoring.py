"""On-policy scoring under the previous synced version's weights (zrl/trainer/onpolicy.py) on a 1-rank gloo
group: tokens sampled by version 0 and trained at steps 1 and 2 are scored under a copy of version 0, so
`mismatch/onpolicy_*` measures the engine/trainer mismatch although no token of the trained version
exists; the training itself is bit-identical to a run without the scoring.

The "engine" here is the tiny model itself: behaviour logprobs are its own fp32 logprobs with native
routing recorded (router replay then picks the same experts), so under the synced weights the only
difference left is packing's summation order.
"""

import dataclasses

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from zrl.config.schema import Algorithm, DPPOBinaryTV, MuonSpec, Optimizer
from zrl.moepp import load_hf_checkpoint
from zrl.trainer import TrainerSettings, TrainerWorker
from zrl.trainer.onpolicy import SyncedShards, onpolicy_sample, response_prefix
from zrl.models import get_family
from zrl.trainer.synthetic import synthetic_train_batch
from zrl.types import Rollout

pytestmark = pytest.mark.filterwarnings("ignore:.*returned a view tensor")

# KL(q || p) k3 of tokens scored under the weights that sampled them, packed vs one rollout at a time in
# fp32: measured 1.2e-14 under the copy (largest |p - q| 1.2e-9), 1.9e-14 in the loss pass.
SAME_WEIGHTS_KL = 1e-10


def settings(**overrides):
    base = dict(param_dtype="float32", token_budget=256, max_response_tokens=40, kernels="reference",
                optimizer=Optimizer(muon=MuonSpec(lr=1e-2), grad_clip_norm=0.5),
                algorithm=Algorithm(trust_region=DPPOBinaryTV(delta=2e-4), router_bias_update=False))
    base.update(overrides)
    return TrainerSettings(**base)


def sampled_by(model, trainer_step: int, version: int, seed: int, noise: float = 0.0):
    """A batch pulled at `trainer_step` whose every token was sampled by `version` = `model`'s weights,
    behaviour logprobs those of `model` (plus Gaussian `noise`), routing recorded as `model` routes."""
    cfg = model.config
    batch = synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg), num_groups=3, group_size=4, trainer_step=trainer_step,
                                  seed=seed, model=model, logprob_noise=noise, flip_fraction=0.0)
    return dataclasses.replace(batch, groups=tuple(
        dataclasses.replace(g, rollouts=tuple(dataclasses.replace(r, version_segments=((0, version),))
                                              for r in g.rollouts)) for g in batch.groups))


def full_state(worker):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in worker.model.state_dict().items()}


def assert_equal_states(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, single_rank):
    """Three steps on batches sampled by version 0 (the last with perturbed behaviour logprobs), after a
    weight sync at version 0; once with the scoring, once without. Weights after every step."""
    ref = load_hf_checkpoint(tiny_checkpoint)
    batches = [sampled_by(ref, 0, 0, seed=1), sampled_by(ref, 1, 0, seed=2), sampled_by(ref, 2, 0, seed=3, noise=0.2)]
    out = {}
    for name, budget in (("scored", 1024), ("plain", 0)):
        worker = TrainerWorker(single_rank, tiny_checkpoint, settings(onpolicy_mismatch_tokens=budget))
        worker.weights_synced()  # the stage's first sync: the engines hold version 0
        states, metrics, inside = [full_state(worker)], [], None
        for batch in batches:
            metrics.append(worker.train_step(worker.share_of(batch)))
            states.append(full_state(worker))
        if budget:
            with worker.synced.swapped_in(worker.model, worker.version):
                inside = full_state(worker)
            out["after_swap"] = full_state(worker)
            out["copy_version"] = worker.synced.version
        out[name] = {"metrics": metrics, "states": states, "inside": inside, "batches": batches,
                     "share": worker.share_of(batches[1])}
        worker.shutdown()
    return out


def test_scoring_changes_no_weight(runs):
    for scored, plain in zip(runs["scored"]["states"], runs["plain"]["states"]):
        assert_equal_states(scored, plain)
    start, end = runs["plain"]["states"][0], runs["plain"]["states"][3]
    assert any(not torch.equal(start[k], end[k]) for k in start)  # not vacuous
    for a, b in zip(runs["scored"]["metrics"], runs["plain"]["metrics"]):
        for key in ("loss/policy", "grad/norm_total", "mismatch/kl_k3", "trust_region/masked_frac"):
            assert a[key] == b[key], key


def test_the_copy_holds_the_synced_weights_and_the_swap_restores_the_current_ones(runs):
    # No sync after version 0: after three steps the copy still holds version 0, bit for bit.
    assert runs["copy_version"] == 0
    assert_equal_states(runs["scored"]["inside"], runs["scored"]["states"][0])
    assert_equal_states(runs["after_swap"], runs["scored"]["states"][3])


def test_tokens_of_the_synced_version_are_scored_under_its_weights(runs):
    scored, plain = runs["scored"]["metrics"], runs["plain"]["metrics"]
    # Step 0 trains version 0 itself: the loss pass scores every token (lag 0), nothing else runs.
    assert scored[0]["mismatch/onpolicy_num_tokens"] == scored[0]["mismatch/num_tokens"] > 0
    assert scored[0]["mismatch/onpolicy_version_lag"] == 0
    assert scored[0]["mismatch/onpolicy_kl_k3"] < SAME_WEIGHTS_KL
    # Step 1 trains version 1 on tokens of version 0: without the copy, no on-policy token at all.
    assert plain[1]["mismatch/onpolicy_num_tokens"] == 0
    first = scored[1]
    share = runs["scored"]["share"]
    sample = onpolicy_sample(share.rollouts, 0, max_scored_tokens=1024, max_input_tokens=256, seed=(1, 0))
    # measured 132 of the 157 loss tokens: the sample is one microbatch of at most token_budget tokens
    assert first["mismatch/onpolicy_num_tokens"] == sum(len(r.token_ids) for r in sample) > 0
    assert first["mismatch/onpolicy_version_lag"] == 1
    # Under the copy the engine's logprobs are reproduced (measured k3 1.2e-14); under the weights being
    # trained the same tokens differ by the step's policy change (measured k3 2.3e-2).
    assert first["mismatch/onpolicy_kl_k3"] < SAME_WEIGHTS_KL
    assert first["mismatch/onpolicy_max_abs_prob_diff"] < 1e-6
    assert first["mismatch/kl_k3"] > 1e-4
    # Step 2 (behaviour logprobs perturbed by N(0, 0.2)): the mismatch shows, two steps behind.
    second = scored[2]
    assert second["mismatch/onpolicy_version_lag"] == 2
    assert second["mismatch/onpolicy_kl_k3"] > 1e-3  # measured 2.0e-2
    assert second["perf/onpolicy_s"] > 0 and plain[2]["perf/onpolicy_s"] == 0


def _rollout(prompt_len: int, versions: list[int], policy_mask=None) -> Rollout:
    n = len(versions)
    starts = [0] + [i for i in range(1, n) if versions[i] != versions[i - 1]]
    return Rollout(prompt_ids=np.arange(1, prompt_len + 1, dtype=np.int32), token_ids=np.arange(n, dtype=np.int32) + 7,
                   logprobs=-np.arange(1, n + 1, dtype=np.float32), routing=np.zeros((prompt_len + n, 2), np.uint8),
                   version_segments=tuple((s, versions[s]) for s in starts), finish_reason="stop",
                   policy_mask=policy_mask)


def test_sample_takes_prefixes_up_to_the_token_budget():
    old_then_new = _rollout(3, [4, 4, 4, 5, 5])  # a weight sync mid-rollout
    new_only = _rollout(2, [5, 5])
    multi_turn = _rollout(4, [4, 4, 4, 4], policy_mask=np.array([True, False, True, True]))
    rollouts = [old_then_new, new_only, multi_turn]
    everything = onpolicy_sample(rollouts, 4, max_scored_tokens=100, max_input_tokens=100, seed=(0, 0))
    assert sorted(len(r.token_ids) for r in everything) == [3, 4]  # version-5 tail cut, version-5 rollout skipped
    for budget in (1, 2, 4):
        sample = onpolicy_sample(rollouts, 4, max_scored_tokens=budget, max_input_tokens=100, seed=(0, 0))
        scored = sum(int(((r.token_versions() == 4) & (r.policy_mask if r.policy_mask is not None else True)).sum())
                     for r in sample)
        assert scored == budget
    # A prefix keeps every array consistent (the Rollout checks lengths) and its tokens' values.
    cut = response_prefix(old_then_new, 2)
    assert cut.routing.shape[0] == 5 and cut.version_segments == ((0, 4),) and list(cut.logprobs) == [-1, -2]
    # The packed length stays within max_input_tokens after the first rollout taken.
    small = onpolicy_sample(rollouts, 4, max_scored_tokens=100, max_input_tokens=6, seed=(0, 0))
    assert len(small) == 1



def test_which_version_a_step_scores_and_when_the_copy_refreshes():
    synced = SyncedShards()
    assert synced.scored_version(3, 2) is None  # no copy yet
    synced.synced(3)
    assert synced.refreshes(3) and not synced.refreshes(4)
    synced.version, synced.pending = 3, None  # what the step at 3 leaves (refresh)
    assert synced.scored_version(3, 2) is None  # version 3 itself: the loss pass scores it
    assert synced.scored_version(4, 1) == 3 and synced.scored_version(5, 2) == 3
    assert synced.scored_version(5, 1) is None  # the batch's tokens are all newer than the copy
    synced.drop()
    assert synced.version is None and synced.pending is None and synced.num_bytes == 0
