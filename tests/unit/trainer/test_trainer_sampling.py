"""The stage's sampling settings reach the trainer's objective, and the RL loss takes its logprobs under them."""

import dataclasses

import torch

from zrl.config.schema import RLStage, SFTStage
from zrl.moepp import load_hf_checkpoint
from zrl.modeling.logprobs import SamplingDistribution
from zrl.trainer.batch import pack_rollouts
from zrl.trainer.packing import input_length, plan_rank
from zrl.trainer.loss import RLObjective, rl_microbatch_loss
from zrl.trainer.settings import TrainerSettings
from zrl.models import get_family
from zrl.trainer.synthetic import synthetic_train_batch

ENVIRONMENTS = [{"name": "arithmetic"}]


def test_stage_sampling_reaches_the_objective():
    stage = RLStage(name="rl", steps=2, environments=ENVIRONMENTS,
                    sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05})
    settings = TrainerSettings.from_stage(stage, token_budget=64)
    expected = SamplingDistribution(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)
    assert settings.sampling == expected
    assert settings.objective().sampling == expected
    default = TrainerSettings.from_stage(RLStage(name="rl", steps=2, environments=ENVIRONMENTS))
    assert default.objective().sampling == SamplingDistribution(top_k=-1)
    assert not default.objective().sampling.filtered  # the schema's top_k = -1 means off
    sft = TrainerSettings.from_stage(SFTStage(name="sft", kind="sft", steps=2, environments=ENVIRONMENTS))
    assert sft.sampling == SamplingDistribution()


def test_rl_loss_takes_logprobs_under_the_objectives_distribution(tiny_checkpoint):
    model = load_hf_checkpoint(tiny_checkpoint)
    cfg = model.config
    batch = synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg), num_groups=2, group_size=3, seed=5, model=model)
    rollouts = batch.rollouts()
    lengths = [input_length(len(r.prompt_ids), len(r.token_ids)) for r in rollouts]
    [indices, *_] = plan_rank(lengths, 0, 1, 4096).microbatches
    mb = pack_rollouts(rollouts, batch.advantages(), indices, num_layers=cfg.num_hidden_layers, replay=True,
                       device=torch.device("cpu"))
    sampling = SamplingDistribution(temperature=0.7, top_p=0.9)
    objective = RLObjective("dppo_binary_tv", {"delta": 0.2, "is_cap": 10.0}, "token_mean", 64, sampling=sampling)

    def loss(obj):
        return rl_microbatch_loss(model, mb, obj, global_num_seqs=batch.num_sequences,
                                  global_num_tokens=batch.num_response_tokens, trainer_step=batch.trainer_step)

    out = loss(objective)
    with torch.no_grad():
        direct = model.token_logprobs(mb.input_ids, mb.targets, cu_seqlens=mb.cu_seqlens, routing_replay=mb.routing,
                                      sampling=sampling).logprobs
    torch.testing.assert_close(out.logprobs, direct, rtol=0, atol=0)
    plain = loss(dataclasses.replace(objective, sampling=SamplingDistribution()))
    assert (plain.logprobs - out.logprobs)[mb.loss_mask].abs().max() > 1e-2
