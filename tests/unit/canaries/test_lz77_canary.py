"""Streaming LZ77 canary: byte encoding, chunking, calibration claims, and the reward gate.

Measured values quoted here come from compressibility.py's docstring (zlib 1.2.13, 3 B/token,
C = 64, tau = 0.05): copy floor 0.021, uniform random ids >= 0.98, loops of period <= 254 flagged
within P + 2C tokens.
"""

import zlib

import numpy as np
import pytest

from zrl.canaries.calibration import loop_detection, random_ratio_floor
from zrl.canaries.compressibility import (
    BYTES_PER_TOKEN,
    CHUNK_TOKENS,
    REPEAT_THRESHOLD,
    StreamingCompressibility,
    chunk_ratios,
    compressibility_report,
    repetition_gate,
    sync_flush_overhead_bytes,
    token_bytes,
)

V = 262_272
C = CHUNK_TOKENS


def _loop(rng, prefix_tokens, period, loop_tokens):
    unit = rng.integers(0, V, size=period)
    return np.concatenate([rng.integers(0, V, size=prefix_tokens),
                           np.tile(unit, loop_tokens // period + 1)[:loop_tokens]])


def _reference_ratios(ids, chunk_bounds):
    # eq. 16 written out: one compressor, sync flush per chunk, empty-flush overhead subtracted
    z = zlib.compressobj(1, zlib.DEFLATED, -10)
    ovh = len(zlib.compressobj(1, zlib.DEFLATED, -10).flush(zlib.Z_SYNC_FLUSH))
    raw = b"".join(int(i).to_bytes(3, "little") for i in ids)
    out = []
    for s, e in chunk_bounds:
        chunk = raw[3 * s:3 * e]
        n = len(z.compress(chunk)) + len(z.flush(zlib.Z_SYNC_FLUSH))
        out.append(max(0, n - ovh) / len(chunk))
    return out


def test_constants_are_the_calibrated_choice():
    assert (BYTES_PER_TOKEN, CHUNK_TOKENS, REPEAT_THRESHOLD) == (3, 64, 0.05)
    empty_flush = zlib.compressobj(1, zlib.DEFLATED, -10).flush(zlib.Z_SYNC_FLUSH)
    assert sync_flush_overhead_bytes() == len(empty_flush) > 0


def test_token_bytes_little_endian_fixed_width():
    assert token_bytes([1, 256, 65538]) == bytes([1, 0, 0, 0, 1, 0, 2, 0, 1])
    assert token_bytes([258], bytes_per_token=2) == bytes([2, 1])
    assert token_bytes([258], bytes_per_token=4) == bytes([2, 1, 0, 0])
    assert token_bytes([]) == b""
    for bad, width in (([-1], 3), ([2 ** 24], 3), ([70000], 2)):
        with pytest.raises(ValueError, match="lie in"):
            token_bytes(bad, bytes_per_token=width)
    with pytest.raises(ValueError, match="integers"):
        token_bytes([1.5])
    with pytest.raises(ValueError, match="1-D"):
        token_bytes([[1, 2]])
    with pytest.raises(ValueError, match="bytes_per_token"):
        token_bytes([1], bytes_per_token=5)


@pytest.mark.parametrize("n, bounds", [
    (0, []),
    (20, [(0, 20)]),                              # shorter than a chunk: one chunk
    (C, [(0, C)]),
    (2 * C - 1, [(0, 2 * C - 1)]),                # short tail merged into the only full chunk
    (2 * C, [(0, C), (C, 2 * C)]),
    (3 * C + 5, [(0, C), (C, 2 * C), (2 * C, 3 * C + 5)]),
])
def test_chunking_merges_short_final_chunk(n, bounds):
    ids = np.random.default_rng(n).integers(0, V, size=n)
    assert chunk_ratios(ids).tolist() == pytest.approx(_reference_ratios(ids, bounds), abs=0)


def test_streaming_feed_in_pieces_matches_whole():
    ids = _loop(np.random.default_rng(3), 150, 37, 400)
    stream = StreamingCompressibility()
    got = []
    for s in range(0, ids.size, 23):
        got += stream.feed(ids[s:s + 23])
    got += stream.finish()
    assert got == chunk_ratios(ids).tolist()
    with pytest.raises(RuntimeError):
        stream.feed([1])
    with pytest.raises(RuntimeError):
        stream.finish()


@pytest.mark.parametrize("period", [1, 2, 3, 17, 64, 100, 150, 200, 254])
def test_exact_repetition_is_flagged(period):
    rng = np.random.default_rng(period)
    ids = _loop(rng, 2 * C + 13, period, 1000)
    rep = compressibility_report(ids)
    assert rep.flagged
    assert rep.min_ratio < 0.03  # copy floor measured 0.021 for every period <= 254


def test_repetition_starting_mid_rollout_is_flagged_after_its_start():
    rng = np.random.default_rng(7)
    start, period = 1000, 90
    ids = _loop(rng, start, period, 600)
    ratios = chunk_ratios(ids)
    flagged = np.nonzero(ratios < REPEAT_THRESHOLD)[0]
    assert flagged.size > 0
    first_loop_chunk = start // C
    assert flagged.min() >= first_loop_chunk  # nothing before the loop
    # detection latency bound measured by calibration: within P + 2C looping tokens
    assert (flagged.min() + 1) * C - start <= period + 2 * C


def test_random_and_natural_like_streams_are_not_flagged():
    rng = np.random.default_rng(11)
    for _ in range(4):
        uniform = rng.integers(0, V, size=4096)
        assert compressibility_report(uniform).min_ratio > 0.9  # measured floor 0.98-1.03
        # Zipf-distributed ids (peaked like natural token frequencies): measured minima 0.21 (a = 2) to 0.6
        for a in (1.1, 2.0):
            zipf = np.minimum(rng.zipf(a, size=4096) - 1, V - 1)
            rep = compressibility_report(zipf)
            assert not rep.flagged and rep.min_ratio > 0.15
        # tiny vocabularies (the CPU test model): uniform over 16 ids measured 0.36
        assert compressibility_report(rng.integers(0, 16, size=4096)).min_ratio > 0.25


def test_loops_longer_than_the_window_are_not_detected():
    # 3 B/token x 254 tokens = 762 usable window bytes; a period of 300 is out of reach (documented limit)
    ids = _loop(np.random.default_rng(5), 2 * C, 300, 1500)
    assert not compressibility_report(ids).flagged


def test_short_and_empty_rollouts():
    rng = np.random.default_rng(2)
    empty = compressibility_report([])
    assert empty.ratios.size == 0 and empty.min_ratio == float("inf") and not empty.flagged
    assert not compressibility_report(rng.integers(0, V, size=10)).flagged
    # too short to tell: 10 identical tokens measured r = 0.23
    assert not compressibility_report([1234] * 10).flagged
    # a short rollout that repeats itself is caught: 63 identical tokens measured r = 0.042
    assert compressibility_report([1234] * 63).flagged


def test_threshold_validation_and_gate():
    with pytest.raises(ValueError, match="threshold"):
        compressibility_report([1, 2, 3], threshold=0.0)
    assert repetition_gate(1.0, True) == 0.0
    assert repetition_gate(1.0, False) == 1.0
    assert repetition_gate(0.4, False) == 0.4


def test_calibration_sweep_reproduces_documented_detection():
    phases = range(0, C, 16)
    for period in (1, 30, 150, 254):
        det = loop_detection(period, phases=phases, loop_tokens=1024, seed=period)
        assert det.worst_latency_tokens is not None and det.worst_latency_tokens <= period + 2 * C
        assert det.min_ratio < 0.03 and not det.prefix_flagged
    missed = loop_detection(255, phases=phases, loop_tokens=1024, seed=255)
    assert missed.worst_latency_tokens is None
    assert random_ratio_floor(num_rollouts=2) > 0.9
