"""Warmup + constant/cosine LR multiplier and the LambdaLR factory on MuonAdamW."""

import math

import pytest
import torch

from zrl.optim import AdamWHyperparams, MuonAdamW, MuonHyperparams, WarmupSchedule, lr_scheduler


def test_warmup_then_constant():
    sched = WarmupSchedule(warmup_steps=4)
    assert [sched(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert WarmupSchedule()(0) == 1.0  # no warmup: full lr from the first step


def test_warmup_then_cosine_hand_values():
    sched = WarmupSchedule(warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    assert sched(0) == 0.5 and sched(1) == 1.0
    assert sched(2) == pytest.approx(1.0)  # progress 0
    assert sched(3) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))  # 0.868198
    assert sched(4) == pytest.approx(0.55)  # progress ½: halfway between 1 and 0.1
    assert sched(6) == pytest.approx(0.1) and sched(50) == pytest.approx(0.1)  # floor after the end


@pytest.mark.parametrize("kwargs, match", [
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(schedule="linear"), "schedule"),
    (dict(schedule="cosine"), "total_steps"),
    (dict(schedule="cosine", warmup_steps=5, total_steps=5), "total_steps"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio"),
])
def test_bad_schedules_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupSchedule(**kwargs)


def _optimizer():
    w_muon, w_adamw = torch.zeros(3, 3, requires_grad=True), torch.zeros(3, requires_grad=True)
    return MuonAdamW([{"params": [w_muon], "optimizer": "muon"}, {"params": [w_adamw], "optimizer": "adamw"}],
                     muon=MuonHyperparams(lr=0.02), adamw=AdamWHyperparams(lr=0.001))


def test_one_schedule_scales_both_groups():
    opt = _optimizer()
    sched = lr_scheduler(opt, warmup_steps=2, schedule="cosine", total_steps=4)
    seen = []
    for _ in range(5):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    expected = [0.5, 1.0, 1.0, 0.5, 0.0]
    for (muon_lr, adamw_lr), mult in zip(seen, expected):
        assert muon_lr == pytest.approx(0.02 * mult, abs=1e-15)
        assert adamw_lr == pytest.approx(0.001 * mult, abs=1e-15)


def test_scheduler_state_round_trip():
    opt = _optimizer()
    sched = lr_scheduler(opt, warmup_steps=3)
    opt.step()
    sched.step()
    opt2 = _optimizer()
    sched2 = lr_scheduler(opt2, warmup_steps=3)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for a, b in ((opt, sched), (opt2, sched2)):
        a.step()
        b.step()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups] == [0.02, 0.001]
