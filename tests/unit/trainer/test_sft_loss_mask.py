"""SFTExample.loss_mask: in a multi-turn demonstration the environment's tokens are inputs, never targets
of the loss; an example without a mask trains every response token, beside masked ones in one microbatch."""

import numpy as np
import pytest
import torch

from zrl.trainer.batch import SFTExample, pack_sft

CPU = torch.device("cpu")


def test_masked_tokens_are_inputs_but_carry_no_target():
    turns = SFTExample(np.array([1, 2]), np.array([3, 4, 5, 6, 7]), np.array([True, False, False, True, True]))
    plain = SFTExample(np.array([8]), np.array([9, 10]))
    mb = pack_sft([turns, plain], [0, 1], device=CPU)
    assert mb.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 8, 9]
    assert mb.targets.tolist() == [2, 3, 4, 5, 6, 7, 9, 10]
    assert mb.loss_mask.tolist() == [False, True, False, False, True, True, True, True]
    assert mb.targets[mb.loss_mask].tolist() == [3, 6, 7, 9, 10]  # the environment's 4 and 5 are no target
    assert mb.advantages.tolist() == [0, 1, 0, 0, 1, 1, 1, 1]
    assert (turns.num_trained_tokens, plain.num_trained_tokens) == (3, 2)


def test_a_batch_without_masks_trains_every_response_token():
    mb = pack_sft([SFTExample(np.array([1, 2]), np.array([3, 4]))], [0], device=CPU)
    assert mb.loss_mask.tolist() == [False, True, True]


def test_the_mask_must_cover_the_response():
    with pytest.raises(ValueError, match=r"loss_mask must be a \[3\] bool array, got bool \(2,\)"):
        SFTExample(np.array([1]), np.array([2, 3, 4]), np.array([True, False]))
    with pytest.raises(ValueError, match=r"loss_mask must be a \[2\] bool array, got int64"):
        SFTExample(np.array([1]), np.array([2, 3]), np.array([1, 0]))
