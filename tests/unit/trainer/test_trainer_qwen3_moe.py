"""TrainerWorker on a Qwen3-MoE checkpoint (the second model family) on a 1-rank gloo group: one RL step
with router replay of [T, L * k] records equals the step computed rollout by rollout, the export is a
checkpoint transformers loads, and weight sync sends its keys."""

import dataclasses

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from zrl.config.schema import Algorithm, DPPOBinaryTV, MuonSpec, Optimizer
from zrl.qwen3_moe import load_hf_checkpoint
from zrl.trainer import TrainerSettings, TrainerWorker
from zrl.models import get_family
from zrl.trainer.synthetic import synthetic_train_batch
from zrl.types import NO_ROUTE

from trainer_testlib import assert_grads_close, reference

pytestmark = pytest.mark.filterwarnings("ignore:.*returned a view tensor")


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    return get_family("qwen3_moe").build_tiny(tmp_path_factory.mktemp("trainer_qwen3_moe") / "model")


def settings(**overrides):
    base = dict(param_dtype="float32", token_budget=40, max_response_tokens=40,
                optimizer=Optimizer(muon=MuonSpec(lr=1e-2), grad_clip_norm=0.5),
                algorithm=Algorithm(trust_region=DPPOBinaryTV(delta=2e-4), router_bias_update=False))
    base.update(overrides)
    return TrainerSettings(**base)


def perturbed_records(batch, config, fraction=0.25, seed=0):
    """The batch with a `fraction` of its recorded (token, sparse layer) entries replaced by k other
    distinct experts: the engine's top-k differs from the trainer's there, as after a weight change."""
    rng = np.random.default_rng(seed)
    k, moe = config.num_experts_per_tok, list(config.moe_layers)

    def perturb(rollout):
        record = rollout.routing.copy().reshape(len(rollout.routing), config.num_hidden_layers, k)
        for t in range(len(record) - 1):  # the last token's row stays NO_ROUTE
            for layer in moe:
                if rng.random() < fraction:
                    record[t, layer] = rng.choice(config.num_experts, size=k, replace=False)
        return dataclasses.replace(rollout, routing=record.reshape(len(record), -1))

    groups = tuple(dataclasses.replace(g, rollouts=tuple(perturb(r) for r in g.rollouts)) for g in batch.groups)
    return dataclasses.replace(batch, groups=groups)


def qwen_batch(model, trainer_step=0):
    cfg = model.config
    batch = synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg),
                                  num_groups=3, group_size=4, trainer_step=trainer_step, seed=3, model=model,
                                  flip_fraction=0.0, logprob_noise=0.2)
    return perturbed_records(batch, cfg)


def full_state(worker):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in worker.model.state_dict().items()}


def test_rl_step_with_topk_replay_equals_reference_and_exports(qwen_checkpoint, single_rank, tmp_path):
    ref = load_hf_checkpoint(qwen_checkpoint)
    cfg = ref.config
    batch = qwen_batch(ref)
    record = batch.groups[0].rollouts[0].routing
    assert record.shape[1] == cfg.num_hidden_layers * cfg.num_experts_per_tok  # [T, L * k]
    assert (record[:, 1 * 2:2 * 2] == NO_ROUTE).all()  # the dense layer 1 has no record
    s = settings()
    worker = TrainerWorker(single_rank, qwen_checkpoint, s)
    assert worker.family.model_type == "qwen3_moe" and worker.shape.routing_width == 6
    names = {id(p): n for n, p in worker.model.named_parameters()}
    grads = {}
    worker.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.update(
        {names[id(p)]: p.grad.full_tensor().clone() for g in opt.param_groups for p in g["params"]
         if p.grad is not None}))
    before = full_state(worker)
    metrics = worker.train_step(worker.share_of(batch))

    ref_loss, ref_grads, facts = reference(ref, batch, s.objective())
    assert metrics["loss/policy"] == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_close(grads, ref_grads)
    # the recorded experts were replayed: the disagreement is the perturbation's, counted per recorded id
    assert metrics["routing/replay_disagree_frac"] == pytest.approx(facts["disagree"] / facts["recorded"])
    assert 0.1 < metrics["routing/replay_disagree_frac"] < 0.5
    assert 0 < metrics["routing/load_entropy_mean"] <= 1 and "routing/skip_frac_mean" not in metrics
    after = full_state(worker)
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # export: transformers loads it and computes what the trained policy computes
    out = tmp_path / "export"
    worker.export_hf(out, dtype=None)
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_hf_checkpoint(out)
    assert all(torch.equal(ours.state_dict()[k], after[k]) for k in after)
    ids = torch.tensor(batch.groups[0].rollouts[0].prompt_ids, dtype=torch.int64)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids[None]).logits[0].float(), ours(ids).logits, rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").exists()

    # weight sync streams the exported files' keys
    sent = {k for bucket in worker.export_weights(dtype=torch.bfloat16) for k, _ in bucket.tensors}
    files = set()
    for file in out.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            files.update(f.keys())
    assert sent == files
    worker.shutdown()


def test_a_record_of_the_wrong_width_is_refused(qwen_checkpoint, single_rank):
    ref = load_hf_checkpoint(qwen_checkpoint)
    batch = qwen_batch(ref)
    narrow = dataclasses.replace(batch, groups=tuple(
        dataclasses.replace(g, rollouts=tuple(dataclasses.replace(r, routing=r.routing[:, :3]) for r in g.rollouts))
        for g in batch.groups))
    worker = TrainerWorker(single_rank, qwen_checkpoint, settings())
    with pytest.raises(ValueError, match="the model has 6 routing columns"):
        worker.train_step(worker.share_of(narrow))


def test_router_bias_update_is_refused(qwen_checkpoint, single_rank):
    with pytest.raises(ValueError, match="router_bias_update: qwen3_moe models have no router balancing biases"):
        TrainerWorker(single_rank, qwen_checkpoint,
                      settings(algorithm=Algorithm(trust_region=DPPOBinaryTV(delta=2e-4), router_bias_update=True)))
