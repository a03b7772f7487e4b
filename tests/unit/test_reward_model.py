"""zrl/reward_model.py in process: scores equal a plain transformers forward, batching/padding and
truncation do what the module promises, the reward normalisation's edge cases, the tiny RM's learned
preference on held-out words, one-line errors.

The tiny RM is built once per test session (10-20 s on 2 cores).
"""

import json
import logging
import math
import random
import shutil

import pytest
import torch

from zrl.config.schema import RewardModelSpec
from zrl.reward_model import (COURTESY, TINY_RM_MANIFEST, RewardModel, RewardModelClient, preference_pair,
                              prepare_reward_model, reward)
from zrl.types import Message

log = logging.getLogger(__name__)
# fp32 scores of the tiny RM (|s| <= 5): a single unpadded conversation through RewardModel measured 0.0
# against the direct forward, padded batches of 3-32 measured 1.4e-6 (2026-11-24, 2-core x86_64). 1e-5 leaves
# room for other x86-64 CPUs, whose SIMD widths sum in other orders.
FP32_ATOL = 1e-5
# bf16 (the schema's default dtype) against fp32: measured max 0.043 over 40 conversations; 0.15 leaves room
# for CPUs with native bf16 arithmetic (this one emulates it). Chosen-rejected margins are >= 1.7.
BF16_ATOL = 0.15
# Held-out pair accuracy measured 1.0 (200 pairs at build time, 200 other pairs here, fp32 and bf16;
# smallest margin 1.7).
MIN_PAIR_ACCURACY = 0.95


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory):
    """The tiny RM, built the way a recipe asks for it."""
    path = tmp_path_factory.mktemp("reward_model") / "tiny-rm"
    return prepare_reward_model(RewardModelSpec(path=str(path), build_tiny_if_missing=True))


def spec(path, **fields) -> RewardModelSpec:
    return RewardModelSpec(path=str(path), **{"dtype": "float32", **fields})


def heldout_conversations(pairs: int, seed: str = "unit") -> list[tuple[tuple[Message, ...], str]]:
    """Chosen, rejected, chosen, rejected, ... for `pairs` held-out pairs."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(pairs):
        messages, chosen, rejected = preference_pair(rng, "eval")
        conversations += [(messages, chosen), (messages, rejected)]
    return conversations


@torch.no_grad()
def direct_scores(path, conversations) -> list[float]:
    """The plain transformers way: render, tokenize, one conversation per forward, logit 0."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    scores = []
    for messages, response in conversations:
        chat = [{"role": m.role, "content": m.content} for m in messages] + [{"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        scores.append(float(model(ids).logits[0, 0]))
    return scores


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_the_manifest_records_a_high_heldout_accuracy(tiny_rm):
    manifest = json.loads((tiny_rm / TINY_RM_MANIFEST).read_text())
    assert manifest["seed"] == 0 and manifest["steps"] > 0
    assert manifest["heldout_pair_accuracy"] >= MIN_PAIR_ACCURACY


def test_scores_equal_a_direct_forward_and_do_not_depend_on_the_batch(tiny_rm):
    conversations = heldout_conversations(20)
    # Lengths differ (instructions, formats): batches of 3 and 8 pad most rows.
    assert len({len(RewardModel(spec(tiny_rm)).tokens(c)) for c in conversations}) > 5
    reference = direct_scores(tiny_rm, conversations)
    for batch_size in (1, 3, 8):
        diff = max_abs_diff(RewardModel(spec(tiny_rm, batch_size=batch_size)).scores(conversations), reference)
        log.info("batch size %d: max abs diff %.3g against the direct forward", batch_size, diff)
        assert diff <= FP32_ATOL, batch_size
    # Scores are not all alike: the comparison above can fail.
    assert max(reference) - min(reference) > 1.0


def test_bfloat16_scores_stay_close_to_float32(tiny_rm):
    conversations = heldout_conversations(20)
    fp32 = RewardModel(spec(tiny_rm, batch_size=8)).scores(conversations)
    bf16 = RewardModel(spec(tiny_rm, dtype="bfloat16", batch_size=8)).scores(conversations)
    diff = max_abs_diff(bf16, fp32)
    log.info("bf16 vs fp32 max abs diff %.3g", diff)
    assert diff <= BF16_ATOL


def test_truncation_keeps_the_end(tiny_rm):
    messages, chosen, _ = preference_pair(random.Random(3), "eval")
    long_prompt = (Message("system", "Some context. " * 100),) + messages
    full = RewardModel(spec(tiny_rm)).tokens((long_prompt, chosen))
    model = RewardModel(spec(tiny_rm, max_tokens=24))
    kept = model.tokens((long_prompt, chosen))
    assert len(full) > 24 and kept == full[-24:]
    assert model.tokenizer.decode(kept).endswith(f"{chosen}<|im_end|>\n")
    # Whatever the dropped start was, the score is the same.
    other = (Message("system", "Other words entirely. " * 100),) + messages
    assert model.tokens((other, chosen)) == kept
    assert model.scores([(long_prompt, chosen), (other, chosen)])[0] == pytest.approx(
        model.scores([(other, chosen)])[0], abs=FP32_ATOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tiny_rm_prefers_the_courtesy_on_heldout_words(tiny_rm, dtype):
    scores = RewardModel(spec(tiny_rm, dtype=dtype, batch_size=16)).scores(heldout_conversations(100))
    accuracy = sum(c > r for c, r in zip(scores[0::2], scores[1::2])) / 100
    log.info("%s held-out pair accuracy %.3f, smallest margin %.2f", dtype, accuracy,
             min(c - r for c, r in zip(scores[0::2], scores[1::2])))
    assert accuracy >= MIN_PAIR_ACCURACY


def test_the_preference_is_about_the_courtesy_sentence():
    rng, closing = random.Random(0), 0
    for _ in range(200):
        messages, chosen, rejected = preference_pair(rng, "eval")
        # Separators: a space, a new line, a new line escaped in JSON.
        without = {chosen.replace(separator + courtesy, "", 1) for separator in (" ", "\n", "\\n")
                   for courtesy in (COURTESY, COURTESY.upper(), COURTESY.lower())} - {chosen}
        assert without == {rejected}, (chosen, rejected)
        assert messages[0].content.startswith("Repeat the word ")
        closing += chosen.rstrip('"}').lower().endswith(COURTESY.lower())
    # The courtesy closes 3/4 of the responses (those without trailing lines, half of the others) and
    # precedes trailing lines in the rest.
    assert 120 < closing < 180


def test_reward_normalisation():
    centred = RewardModelSpec(path="rm", score_center=2.0, score_scale=0.5)
    assert reward(2.0, centred) == 0.5
    assert reward(2.5, centred) == pytest.approx(1 / (1 + math.exp(-1)))
    values = [reward(s, centred) for s in (-50.0, -3.0, 0.0, 1.9, 2.1, 4.0, 50.0)]
    assert values == sorted(values) and len(set(values)) == len(values)
    for huge in (1e300, -1e300, 1e6, -1e6):  # no overflow; the contract's [0, 1]
        assert 0.0 <= reward(huge, centred) <= 1.0
    assert reward(1e6, centred) == 1.0 and reward(-40.0, RewardModelSpec(path="rm")) > 0.0
    assert math.isnan(reward(math.nan, centred))  # the pipeline's reward check counts it, reward 0
    with pytest.raises(ValueError, match="score_scale"):
        RewardModelSpec(path="rm", score_scale=0.0)


def test_local_client_returns_score_and_reward(tiny_rm):
    conversations = heldout_conversations(3)
    rm_spec = spec(tiny_rm, score_center=1.0)
    outcomes = RewardModelClient.local(rm_spec).score(conversations)
    scores = RewardModel(rm_spec).scores(conversations)
    assert [s for s, _ in outcomes] == pytest.approx(scores, abs=FP32_ATOL)
    assert [r for _, r in outcomes] == [reward(s, rm_spec) for s, _ in outcomes]


def one_line_error(exc_info, *needles: str) -> None:
    message = str(exc_info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_missing_checkpoint_errors_are_one_line(tmp_path):
    missing = RewardModelSpec(path=str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError) as exc_info:
        prepare_reward_model(missing)
    one_line_error(exc_info, "reward_model.path", "build_tiny_if_missing")
    with pytest.raises(FileNotFoundError) as exc_info:
        RewardModel(missing)
    one_line_error(exc_info, "reward_model.path")


def test_unfit_checkpoint_errors_are_one_line(tiny_rm, tmp_path):
    with pytest.raises(ValueError) as exc_info:
        RewardModel(spec(tiny_rm, max_tokens=100_000))
    one_line_error(exc_info, "reward_model.max_tokens=100000")
    two_labels = shutil.copytree(tiny_rm, tmp_path / "two-labels")
    config = json.loads((two_labels / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    config["label2id"] = {"a": 0, "b": 1}
    (two_labels / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as exc_info:
        RewardModel(spec(two_labels))
    one_line_error(exc_info, "reward_model.path", "2 labels")
