"""Rollout canaries: LZ77 compressibility (a reward gate), rare-token and gibberish monitors,
engine/trainer mismatch statistics. See compressibility.py for the calibrated constants.
Names are exported lazily so that the numpy canaries (the rollout worker's, the buffer's) do not
import torch.
"""

from zrl.lazy_exports import module_getattr

_EXPORTS = {
    "BYTES_PER_TOKEN": "compressibility", "CHUNK_TOKENS": "compressibility", "REPEAT_THRESHOLD": "compressibility",
    "CompressibilityReport": "compressibility", "StreamingCompressibility": "compressibility",
    "chunk_ratios": "compressibility", "compressibility_report": "compressibility",
    "repetition_gate": "compressibility", "sync_flush_overhead_bytes": "compressibility",
    "token_bytes": "compressibility",
    "MismatchStats": "mismatch", "merge_mismatch_sums": "mismatch", "mismatch_stats": "mismatch",
    "mismatch_sums": "mismatch",
    "RARE_TOKEN_BANDS": "tokens", "gibberish_fraction": "tokens", "gibberish_mask": "tokens",
    "rare_band_start": "tokens", "rare_token_fractions": "tokens",
}

__all__ = sorted(_EXPORTS)

__getattr__ = module_getattr(__name__, _EXPORTS)
