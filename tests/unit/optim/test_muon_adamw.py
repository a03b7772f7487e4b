"""MuonAdamW on plain tensors: parity with torch.optim.Muon / AdamW, statelessness, skips, clipping."""

import copy

import pytest
import torch

from zrl.optim import AdamWHyperparams, MuonAdamW, MuonHyperparams, muon_adamw


def _pm1(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1


def _muon_only(p, **hyper):
    return MuonAdamW([{"params": [p], "optimizer": "muon"}], muon=MuonHyperparams(**hyper))


def _torch_muon(p, momentum=0.0, nesterov=False, lr=0.01, weight_decay=0.1):
    return torch.optim.Muon([p], lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                            adjust_lr_fn="match_rms_adamw")


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (4, 4)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_bitwise_equal_to_torch_muon_when_the_norm_is_exact(shape, nesterov):
    # ±1 gradients have ‖G‖_F = sqrt(numel), a power of two here, so torch's bf16 norm and our fp32
    # norm + 1e-7 normalise identically; from there both run the same bf16 iteration.
    w = torch.randn(shape)
    ours, ref = w.clone().requires_grad_(), w.clone().requires_grad_()
    opt, ref_opt = _muon_only(ours, lr=0.01, weight_decay=0.1, nesterov=nesterov), _torch_muon(ref, nesterov=nesterov)
    for step in range(2):
        ours.grad, ref.grad = _pm1(shape, step), _pm1(shape, step)
        opt.step()
        ref_opt.step()
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_close_to_torch_muon_on_gaussian_gradients(momentum, nesterov):
    # Differences come only from normalising in fp32 (ours) vs bf16 (torch) — and, with momentum,
    # from torch's EMA buffer being (1-μ)× ours — which bf16 NS turns into a few % of the update.
    # Measured worst over these shapes and 3 steps: relative 0.037, cosine 0.99952.
    for shape in [(16, 64), (64, 16), (32, 32), (7, 3)]:
        torch.manual_seed(1)
        w = torch.randn(shape)
        ours, ref = w.clone().requires_grad_(), w.clone().requires_grad_()
        opt = _muon_only(ours, lr=0.01, weight_decay=0.1, momentum=momentum, nesterov=nesterov)
        ref_opt = _torch_muon(ref, momentum, nesterov)
        for _ in range(3):
            g = torch.randn(shape)
            before_ours, before_ref = ours.detach().clone(), ref.detach().clone()
            ours.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            ref_opt.step()
            upd = ours.detach() - before_ours * (1 - 0.01 * 0.1)
            upd_ref = ref.detach() - before_ref * (1 - 0.01 * 0.1)
            assert (upd - upd_ref).norm() / upd_ref.norm() < 0.05, shape
            assert torch.cosine_similarity(upd.flatten(), upd_ref.flatten(), 0) > 0.999, shape


def test_hand_computed_step_on_scaled_identity():
    # W = 0.5·1, g = 3·I₄, lr 0.1, wd 0.5: NS(g) = 0.82421875·I (see test_muon_newton_schulz),
    # W' = 0.5·(1 − 0.05) − 0.1·0.2·sqrt(4)·NS(g).
    w = torch.full((4, 4), 0.5, requires_grad=True)
    opt = _muon_only(w, lr=0.1, weight_decay=0.5)
    w.grad = 3 * torch.eye(4)
    opt.step()
    expected = torch.full((4, 4), 0.5 * 0.95) - 0.1 * 0.4 * 0.82421875 * torch.eye(4)
    assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-7)  # fp32 rounding of two fp32 ops


def _model_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    muon = [torch.randn(6, 10, generator=gen).requires_grad_(), torch.randn(3, 4, 5, generator=gen).requires_grad_()]
    adamw = [torch.randn(7, 6, generator=gen).requires_grad_(), torch.randn(6, generator=gen).requires_grad_()]
    return muon, adamw


def _groups(muon, adamw):
    return [{"params": muon, "optimizer": "muon", "name": "hidden"}, {"params": adamw, "optimizer": "adamw"}]


def _fill_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_no_state_for_muon_parameters():
    muon, adamw = _model_params()
    opt = MuonAdamW(_groups(muon, adamw))
    for step in range(3):
        _fill_grads(muon + adamw, step)
        opt.step()
    assert len(opt.state) == len(adamw) == 2
    assert all(p not in opt.state for p in muon)
    assert sorted(opt.state_dict()["state"]) == [2, 3]  # indices of the AdamW params only


def test_momentum_allocates_one_buffer_per_muon_param():
    muon, adamw = _model_params()
    opt = MuonAdamW(_groups(muon, adamw), muon=MuonHyperparams(momentum=0.9))
    _fill_grads(muon + adamw, 0)
    opt.step()
    assert len(opt.state) == 4 and set(opt.state[muon[1]]) == {"momentum_buffer"}
    assert torch.equal(opt.state[muon[0]]["momentum_buffer"], muon[0].grad)  # m₁ = 0.9·0 + g


def test_adamw_groups_bitwise_equal_to_torch_adamw():
    muon, adamw = _model_params()
    ref = [p.detach().clone().requires_grad_() for p in adamw]
    hyper = AdamWHyperparams(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt = MuonAdamW(_groups(muon, adamw), adamw=hyper)
    ref_opt = torch.optim.AdamW(ref, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for step in range(3):
        _fill_grads(muon + adamw, step)
        for p, r in zip(adamw, ref):
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(adamw, ref):
        assert torch.equal(p, r)


def test_expert_tensor_is_a_batch_of_matrices_and_zero_experts_are_skipped():
    torch.manual_seed(5)
    experts = torch.randn(4, 6, 10, requires_grad=True)  # [E, m, n]
    init = experts.detach().clone()
    grad = torch.randn(4, 6, 10)
    grad[1] = 0.0  # expert 1 received no tokens
    singles = [experts[e].detach().clone().requires_grad_() for e in range(4)]
    opt = _muon_only(experts, lr=0.05, weight_decay=0.1)
    experts.grad = grad
    opt.step()
    assert torch.equal(experts[1], init[1])  # no update and no weight decay
    assert opt.last_muon_stats.skipped == 1 and opt.last_muon_stats.matrices == 3
    for e in (0, 2, 3):
        single_opt = _muon_only(singles[e], lr=0.05, weight_decay=0.1)
        singles[e].grad = grad[e].clone()
        single_opt.step()
        assert torch.equal(experts[e], singles[e]), e  # same NS, same 0.2·sqrt(max(6, 10)) scale


def test_zero_gradient_matrix_and_missing_gradient_leave_weights_untouched():
    w_zero, w_none, w_live = torch.randn(5, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True), \
        torch.randn(5, 3, requires_grad=True)
    before = [w.detach().clone() for w in (w_zero, w_none, w_live)]
    opt = MuonAdamW([{"params": [w_zero, w_none, w_live], "optimizer": "muon"}],
                    muon=MuonHyperparams(lr=0.1, weight_decay=0.5))
    w_zero.grad, w_live.grad = torch.zeros(5, 3), torch.ones(5, 3)
    opt.step()
    assert torch.equal(w_zero, before[0]) and torch.equal(w_none, before[1])
    assert not torch.equal(w_live, before[2])
    assert opt.last_muon_stats.skipped == 1


def test_skip_norm_threshold():
    for skip_norm, moves in ((1e-2, False), (0.0, True)):
        w = torch.ones(3, 3, requires_grad=True)
        opt = _muon_only(w, lr=0.1, weight_decay=0.1, skip_norm=skip_norm)
        w.grad = torch.full((3, 3), 1e-3 / 3)  # ‖g‖_F = 1e-3
        opt.step()
        assert (not torch.equal(w, torch.ones(3, 3))) is moves


def test_group_overrides_and_clip_scale_invariance():
    # Two Muon groups: the override lr halves the step. Scaling the gradient by a power of two
    # (what clipping would do) leaves the Muon update bit-identical.
    ws = [torch.zeros(4, 4, requires_grad=True) for _ in range(3)]
    opt = MuonAdamW([{"params": [ws[0]], "optimizer": "muon"},
                     {"params": [ws[1], ws[2]], "optimizer": "muon", "lr": 0.05}], muon=MuonHyperparams(lr=0.1))
    g = 3 * torch.eye(4)
    ws[0].grad, ws[1].grad, ws[2].grad = g, g, g / 64
    opt.step()
    assert torch.equal(ws[1], ws[0] / 2)
    assert torch.equal(ws[2], ws[1])


def test_state_dict_round_trip():
    for momentum in (0.0, 0.9):
        muon, adamw = _model_params()
        opt = MuonAdamW(_groups(muon, adamw), muon=MuonHyperparams(momentum=momentum))
        for step in range(2):
            _fill_grads(muon + adamw, step)
            opt.step()
        muon2, adamw2 = [copy.deepcopy(p) for p in muon], [copy.deepcopy(p) for p in adamw]
        opt2 = MuonAdamW(_groups(muon2, adamw2), muon=MuonHyperparams(momentum=momentum))
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        _fill_grads(muon + adamw, 7)
        _fill_grads(muon2 + adamw2, 7)
        opt.step()
        opt2.step()
        for a, b in zip(muon + adamw, muon2 + adamw2):
            assert torch.equal(a, b), momentum
        assert len(opt2.state) == (2 if momentum == 0 else 4)


def test_load_state_dict_rejects_swapped_tags():
    muon, adamw = _model_params()
    saved = MuonAdamW(_groups(muon, adamw)).state_dict()
    swapped = MuonAdamW([{"params": adamw, "optimizer": "adamw"}, {"params": muon, "optimizer": "muon"}])
    with pytest.raises(ValueError, match="tags differ"):
        swapped.load_state_dict(saved)


def test_clip_grad_norm_clips_adamw_only_and_reports_both():
    w_muon, w_a, w_b = torch.zeros(2, 2, requires_grad=True), torch.zeros(1, requires_grad=True), \
        torch.zeros(1, requires_grad=True)
    opt = MuonAdamW([{"params": [w_muon], "optimizer": "muon"}, {"params": [w_a, w_b], "optimizer": "adamw"}])
    w_muon.grad = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    w_a.grad, w_b.grad = torch.tensor([6.0]), torch.tensor([8.0])
    norms = opt.clip_grad_norm_(None)
    assert (norms.muon, norms.adamw, norms.adamw_clipped) == (5.0, 10.0, False)
    assert norms.total == pytest.approx(125 ** 0.5, rel=1e-12)
    assert opt.clip_grad_norm_(20.0).adamw_clipped is False and w_a.grad.item() == 6.0
    norms = opt.clip_grad_norm_(1.0)
    assert norms.adamw_clipped and norms.adamw == 10.0
    assert w_a.grad.item() == pytest.approx(0.6, rel=1e-6) and w_b.grad.item() == pytest.approx(0.8, rel=1e-6)
    assert torch.equal(w_muon.grad, torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(0.0)


@pytest.mark.parametrize("groups, match", [
    ([{"params": [torch.randn(2, 2, requires_grad=True)], "optimizer": "sgd"}], "optimizer"),
    ([{"params": [torch.randn(2, 2, requires_grad=True)]}], "optimizer"),
    ([{"params": [torch.randn(2, 2, requires_grad=True)], "optimizer": "muon", "betas": (0.9, 0.9)}], "unknown keys"),
    ([{"params": [torch.randn(4, requires_grad=True)], "optimizer": "muon"}], "2-D"),
    ([{"params": [torch.randn(2, 2, 2, 2, requires_grad=True)], "optimizer": "muon"}], "2-D"),
    ([{"params": [torch.randn(2, 2, requires_grad=True)], "optimizer": "muon", "momentum": 1.0}], "momentum"),
    ([{"params": [torch.randn(2, requires_grad=True)], "optimizer": "adamw", "betas": (1.0, 0.9)}], "betas"),
    ([], "non-empty"),
])
def test_bad_groups_raise_clear_errors(groups, match):
    with pytest.raises(ValueError, match=match):
        MuonAdamW(groups)


def test_bad_hyperparams_and_mode_raise():
    with pytest.raises(ValueError, match="lr"):
        MuonHyperparams(lr=-1.0)
    with pytest.raises(ValueError, match="eps"):
        AdamWHyperparams(eps=0.0)
    with pytest.raises(ValueError, match="distributed_mode"):
        MuonAdamW([{"params": [torch.randn(2, 2, requires_grad=True)], "optimizer": "muon"}],
                  distributed_mode="sharded_matmul")


def test_newton_schulz_batches_are_bounded_and_change_no_update(monkeypatch):
    """Same-shaped matrices run NS in batches of at most NS_BATCH_BYTES of fp32 copies (one job larger
    than that alone), and the updates are those of one batch of everything."""
    torch.manual_seed(11)
    shapes = [(3, 6, 10), (6, 10), (2, 6, 10), (6, 10), (5, 6, 10)]  # 12 matrices of 6 x 10
    grads = [torch.randn(s) for s in shapes]

    def step(budget_matrices: int) -> tuple[list[torch.Tensor], list[int]]:
        monkeypatch.setattr(muon_adamw, "NS_BATCH_BYTES", budget_matrices * 6 * 10 * 4)
        params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        batches = []
        real = muon_adamw.newton_schulz
        monkeypatch.setattr(muon_adamw, "newton_schulz", lambda x, *a: batches.append(x.shape[0]) or real(x, *a))
        opt = MuonAdamW([{"params": params, "optimizer": "muon", "lr": 0.05, "weight_decay": 0.1}])
        opt.step()
        monkeypatch.setattr(muon_adamw, "newton_schulz", real)
        assert opt.last_muon_stats.matrices == 12
        return [p.detach() for p in params], batches

    whole, whole_batches = step(budget_matrices=100)
    bounded, bounded_batches = step(budget_matrices=4)
    assert whole_batches == [12]
    assert bounded_batches == [4, 3, 5]  # (3 + 1), (2 + 1), then the 5-expert job alone though over 4
    for w, b in zip(whole, bounded):
        assert torch.equal(w, b)
