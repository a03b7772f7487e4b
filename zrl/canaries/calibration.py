"""Calibration of the LZ77 canary: detection of exact loops and the ratio floor of random ids.

Responsibility: measure, for a byte width, chunk size and threshold, (1) for each loop period P the
worst-case number of looping tokens before the rollout is flagged, over loop starting phases, and
(2) the smallest chunk ratio of uniform random ids. compressibility.py's constants come from this;
rerun it after changing them: `python -m zrl.canaries.calibration [--bytes 3] [--chunk 64] ...`.

Synthetic loops are the worst case for detection: the looped span is uniform random ids, so nothing
but the repetition itself is compressible.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from zrl.canaries.compressibility import BYTES_PER_TOKEN, CHUNK_TOKENS, REPEAT_THRESHOLD, chunk_ratios

CALIBRATION_VOCAB = 262_272  # ZAYA1 (Gemma3 tokenizer)


@dataclass(frozen=True)
class LoopDetection:
    period: int
    worst_latency_tokens: int | None  # looping tokens until flagged, worst phase; None = missed at a phase
    min_ratio: float  # lowest chunk ratio seen inside the loop, over phases
    prefix_flagged: bool  # a chunk of pure random prefix was already below threshold (false positive)


def loop_detection(period: int, *, phases: Iterable[int], loop_tokens: int = 2048,
                   bytes_per_token: int = BYTES_PER_TOKEN, chunk_tokens: int = CHUNK_TOKENS,
                   threshold: float = REPEAT_THRESHOLD, vocab_size: int = CALIBRATION_VOCAB,
                   seed: int = 0) -> LoopDetection:
    """Flag latency of a loop of `period` random ids that starts after 2C + phase random tokens."""
    rng = np.random.default_rng(seed)
    worst: int | None = 0
    min_ratio = float("inf")
    prefix_flagged = False
    for phase in phases:
        prefix = rng.integers(0, vocab_size, size=2 * chunk_tokens + phase)
        unit = rng.integers(0, vocab_size, size=period)
        loop = np.tile(unit, loop_tokens // period + 1)[:loop_tokens]
        ratios = chunk_ratios(np.concatenate([prefix, loop]), bytes_per_token=bytes_per_token,
                              chunk_tokens=chunk_tokens)
        first_mixed = prefix.size // chunk_tokens  # chunks before this one are pure prefix
        prefix_flagged |= bool(np.any(ratios[:first_mixed] < threshold))
        min_ratio = min(min_ratio, float(ratios[first_mixed:].min()))
        hits = np.nonzero(ratios < threshold)[0]
        if hits.size == 0 or worst is None:
            worst = None
            continue
        # tokens of loop emitted when the flagged chunk ends
        worst = max(worst, int((hits[0] + 1) * chunk_tokens - prefix.size))
    return LoopDetection(period=period, worst_latency_tokens=worst, min_ratio=min_ratio,
                         prefix_flagged=prefix_flagged)


def random_ratio_floor(*, num_rollouts: int = 8, rollout_tokens: int = 4096,
                       bytes_per_token: int = BYTES_PER_TOKEN, chunk_tokens: int = CHUNK_TOKENS,
                       vocab_size: int = CALIBRATION_VOCAB, seed: int = 0) -> float:
    """Smallest chunk ratio over rollouts of uniform random ids."""
    rng = np.random.default_rng(seed)
    return min(float(chunk_ratios(rng.integers(0, vocab_size, size=rollout_tokens),
                                  bytes_per_token=bytes_per_token, chunk_tokens=chunk_tokens).min())
               for _ in range(num_rollouts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=BYTES_PER_TOKEN)
    parser.add_argument("--chunk", type=int, default=CHUNK_TOKENS)
    parser.add_argument("--threshold", type=float, default=REPEAT_THRESHOLD)
    parser.add_argument("--max-period", type=int, default=260)
    parser.add_argument("--phase-step", type=int, default=4)
    args = parser.parse_args(argv)
    phases = range(0, args.chunk, args.phase_step)
    out = sys.stdout
    out.write(f"bytes/token={args.bytes} chunk={args.chunk} tau={args.threshold}: random-id floor "
              f"{random_ratio_floor(bytes_per_token=args.bytes, chunk_tokens=args.chunk):.3f}\n")
    out.write("| period | worst latency (tokens) | min ratio in loop |\n|---|---|---|\n")
    for period in range(1, args.max_period + 1):
        det = loop_detection(period, phases=phases, bytes_per_token=args.bytes, chunk_tokens=args.chunk,
                             threshold=args.threshold, seed=period)
        latency = "missed" if det.worst_latency_tokens is None else str(det.worst_latency_tokens)
        out.write(f"| {period} | {latency} | {det.min_ratio:.3f} |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
