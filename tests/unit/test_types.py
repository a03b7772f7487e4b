"""Rollout records: per-token versions from segments, staleness anchor, shape checks."""

import numpy as np
import pytest

from zrl.types import NO_ROUTE, Rollout


def rollout(r=5, segments=((0, 3),), prompt=2, routing=True):
    return Rollout(prompt_ids=np.arange(prompt, dtype=np.int32), token_ids=np.arange(r, dtype=np.int32),
                   logprobs=np.zeros(r, np.float32),
                   routing=np.full((prompt + r, 2), NO_ROUTE, np.uint8) if routing else None,
                   version_segments=segments, finish_reason="stop")


def test_token_versions_from_segments():
    ro = rollout(r=6, segments=((0, 3), (2, 4), (5, 6)))
    assert ro.token_versions().tolist() == [3, 3, 4, 4, 4, 6]
    assert ro.min_version == 3


def test_a_segment_starting_after_the_last_token_does_not_count():
    ro = rollout(r=2, segments=((0, 7), (2, 8)))  # the update landed as generation finished
    assert ro.token_versions().tolist() == [7, 7] and ro.min_version == 7
    assert rollout(r=0).min_version == 3  # empty response: the version it was started with


@pytest.mark.parametrize("segments", [(), ((1, 3),), ((0, 3), (0, 4)), ((0, 3), (3, 4), (2, 5))])
def test_bad_segments_rejected(segments):
    with pytest.raises(ValueError, match="version_segments"):
        rollout(segments=segments)


def test_shape_checks():
    with pytest.raises(ValueError, match="routing has 3 rows for 7 tokens"):
        Rollout(prompt_ids=np.arange(2), token_ids=np.arange(5), logprobs=np.zeros(5),
                routing=np.zeros((3, 2), np.uint8), version_segments=((0, 0),), finish_reason="stop")
    with pytest.raises(ValueError, match="logprobs has 4 entries for 5"):
        Rollout(prompt_ids=np.arange(2), token_ids=np.arange(5), logprobs=np.zeros(4), routing=None,
                version_segments=((0, 0),), finish_reason="stop")
