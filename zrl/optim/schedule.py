"""Learning-rate schedule shared by the Muon and AdamW groups: linear warmup, then constant or cosine.

Responsibility: a picklable multiplier and a `torch.optim.lr_scheduler.LambdaLR` factory. Every param
group is scaled by the same multiplier of its own base lr, so Muon and AdamW follow one schedule.

Multiplier at scheduler step s (LambdaLR's `last_epoch`; s = 0 is the first optimizer step):
- warmup (s < W):   (s + 1) / W          — the first step already moves, the W-th reaches 1
- constant:          1
- cosine:            r + (1 − r)·½·(1 + cos(π·min(1, (s − W) / (T − W))))   with r = min_lr_ratio
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

Schedule = Literal["constant", "cosine"]


@dataclass(frozen=True)
class WarmupSchedule:
    """Callable LR multiplier; a dataclass (not a lambda) so LambdaLR can save it in its state_dict."""

    warmup_steps: int = 0
    schedule: Schedule = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"cosine needs total_steps > warmup_steps, got total_steps={self.total_steps}, "
                             f"warmup_steps={self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int = 0, schedule: Schedule = "constant",
                 total_steps: int | None = None, min_lr_ratio: float = 0.0) -> LambdaLR:
    """One LambdaLR applying `WarmupSchedule` to every param group (Muon and AdamW alike)."""
    return LambdaLR(optimizer, WarmupSchedule(warmup_steps, schedule, total_steps, min_lr_ratio))
