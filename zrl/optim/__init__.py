"""Optimizers: momentum-free Muon + AdamW in one FSDP2-aware torch optimizer (see README.md here).

Public API:
- `MuonAdamW(groups, muon=MuonHyperparams(...), adamw=AdamWHyperparams(...), distributed_mode=...)`
  with groups `{"params": [...], "optimizer": "muon" | "adamw", **overrides}`;
  `.clip_grad_norm_(max_norm) -> GradNorms`, `.last_muon_stats -> MuonStepStats`.
- `lr_scheduler(optimizer, warmup_steps=, schedule="constant"|"cosine", total_steps=, min_lr_ratio=)`.
- `newton_schulz`, `ns_flops`, `muon_update_scale`: the maths, for benchmarks and tests.
"""

from zrl.optim.muon_adamw import (
    ADAMW,
    MUON,
    AdamWHyperparams,
    GradNorms,
    MuonAdamW,
    MuonHyperparams,
    MuonStepStats,
)
from zrl.optim.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, muon_update_scale, newton_schulz, ns_flops
from zrl.optim.schedule import WarmupSchedule, lr_scheduler

__all__ = [
    "ADAMW",
    "MUON",
    "NS_COEFFICIENTS",
    "NS_EPS",
    "NS_STEPS",
    "AdamWHyperparams",
    "GradNorms",
    "MuonAdamW",
    "MuonHyperparams",
    "MuonStepStats",
    "WarmupSchedule",
    "lr_scheduler",
    "muon_update_scale",
    "newton_schulz",
    "ns_flops",
]
