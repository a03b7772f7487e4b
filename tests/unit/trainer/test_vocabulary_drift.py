"""Why the tool-use recipe's RL export got worse than its training batches (and the guard against it).

AdamW normalises its update per element, so in RL it moves the rows of the tied embedding / LM head of
tokens the policy never samples as far per step as the rows of the tokens it uses, although their
gradient (the softmax's push p_v * A * h, p_v ~ 0) is orders of magnitude smaller. With the AdamW
learning rate of the recipe's RL stage defaulting to Muon's (1.5e-3), 30 steps moved the unused rows by
13 % of their norm (the used rows least), which raised junk tokens until the policy fell into repetition
(`lengths/truncated_frac` 0.77, LZ77-flagged 0.53, held-out accuracy 0.35 -> 0.06 at one policy version);
the LZ77 gate zeroed those rewards and dynamic sampling dropped their groups, so the trained batch's
reward did not show it. The recipe's RL stage now sets AdamW's rate a tenth of Muon's.
"""

from pathlib import Path

import numpy as np
import pytest
import yaml
from torch.distributed.tensor import DTensor

from zrl.config import parse_recipe
from zrl.moepp import load_hf_checkpoint
from zrl.pipeline.controller import trainer_settings
from zrl.trainer import TrainerWorker
from zrl.models import get_family
from zrl.trainer.synthetic import synthetic_train_batch

ROOT = Path(__file__).resolve().parents[3]
USED = 24  # the batches' tokens are ids 3..23; every other row of the 514-token vocabulary is unused
# The largest AdamW drift of an unused vocabulary row element over an RL stage (steps x AdamW lr) that the
# shipped tiny recipes may allow: the collapsed tool-use run allowed 30 x 1.5e-3 = 0.045 (measured 0.0315).
MAX_STAGE_DRIFT = 0.02


def embedding(worker):
    weight = worker.model.embed_tokens.weight
    return (weight.full_tensor() if isinstance(weight, DTensor) else weight).detach().clone()


def rl_steps(checkpoint, rendezvous, settings, steps: int):
    """The embedding before and after `steps` RL steps on batches whose tokens are ids 3..USED-1 only, and the
    last step's embedding gradient."""
    model = load_hf_checkpoint(checkpoint)
    cfg = model.config
    worker = TrainerWorker(rendezvous, checkpoint, settings)
    grads = {}
    worker.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.update(
        embed=worker.model.embed_tokens.weight.grad.full_tensor().clone()))
    before = embedding(worker)
    for step in range(steps):
        batch = synthetic_train_batch(vocab_size=USED, shape=get_family(cfg.model_type).shape(cfg),
                                      num_groups=4, group_size=4, trainer_step=step, seed=step, model=model,
                                      logprob_noise=0.05)
        worker.train_step(worker.share_of(batch))
    after = embedding(worker)
    worker.shutdown()
    return before, after, grads["embed"]


def recipe(name: str):
    data = yaml.safe_load((ROOT / "recipes" / name).read_text())
    return parse_recipe(data)


def test_adamw_moves_unused_vocabulary_rows_as_far_as_used_ones(tiny_checkpoint, single_rank):
    r = recipe("tiny-tools-cpu.yaml")
    stage = r.stages[1]
    settings = trainer_settings(r, stage)
    before, after, grad = rl_steps(tiny_checkpoint, single_rank, settings, steps=2)
    row_grad, row_update = grad.norm(dim=1), (after - before).norm(dim=1)
    used, unused = slice(3, USED), slice(USED, None)
    # the unused rows' gradient is ~150x smaller (measured 6.4e-3 of the used rows' median) ...
    assert row_grad[unused].median() < 0.02 * row_grad[used].median()
    # ... yet Adam moves them as far (measured 0.99 of the used rows' median update)
    assert row_update[unused].median() > 0.5 * row_update[used].median()
    # so what bounds their drift is the AdamW learning rate alone: |update| <= ~lr per element and step
    lr = settings.adamw_hyperparams().lr
    assert (after - before)[unused].abs().max() <= 2 * lr * 1.05


@pytest.mark.parametrize("name", ["tiny-tools-cpu.yaml"])
def test_shipped_rl_stages_bound_the_drift_of_unused_vocabulary_rows(name):
    r = recipe(name)
    for stage in r.stages:
        if stage.kind == "rl":
            lr = trainer_settings(r, stage).adamw_hyperparams().lr
            assert stage.steps * lr <= MAX_STAGE_DRIFT, (stage.name, stage.steps, lr)
