"""Rollout canaries: LZ77 compressibility (a reward gate), rare-token and gibberish monitors,
engine/trainer mismatch statistics. See compressibility.py for the calibrated constants."""

from zrl.canaries.compressibility import (
    BYTES_PER_TOKEN,
    CHUNK_TOKENS,
    REPEAT_THRESHOLD,
    CompressibilityReport,
    StreamingCompressibility,
    chunk_ratios,
    compressibility_report,
    repetition_gate,
    sync_flush_overhead_bytes,
    token_bytes,
)
from zrl.canaries.mismatch import MismatchStats, merge_mismatch_sums, mismatch_stats, mismatch_sums
from zrl.canaries.tokens import (
    RARE_TOKEN_BANDS,
    gibberish_fraction,
    gibberish_mask,
    rare_band_start,
    rare_token_fractions,
)

__all__ = [
    "BYTES_PER_TOKEN", "CHUNK_TOKENS", "RARE_TOKEN_BANDS", "REPEAT_THRESHOLD",
    "CompressibilityReport", "MismatchStats", "StreamingCompressibility",
    "chunk_ratios", "compressibility_report", "gibberish_fraction", "gibberish_mask",
    "merge_mismatch_sums", "mismatch_stats", "mismatch_sums", "rare_band_start", "rare_token_fractions",
    "repetition_gate", "sync_flush_overhead_bytes", "token_bytes",
]
