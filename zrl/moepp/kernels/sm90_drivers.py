"""What sm90_check.py compiles: every Triton launcher of zrl.moepp.kernels driven on meta tensors.

Responsibility: one `drive_<op>` per op, running its launcher forward and backward on meta tensors
(shapes and dtypes, no storage) with the CUDA tile configuration unless a test's own is given, and
DRIVERS: the production shapes (ZAYA1-8B, T = 4096) and every shape / tile configuration / dtype
that a CUDA (`gpu`) case of the kernels' tests (zrl/modeling/kernels/*/test_*.py, zrl/moepp/kernels/*/test_*.py; every test taking the
`device` fixture has one) launches. A `gpu` test whose specialisation is not driven here reaches a
GPU uncompiled: keep the lists in step with the tests.

Invariant: drivers only launch (the recording in sm90_check replaces `kernel[grid](...)`); outputs
of a driven op are meta tensors and are never read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

# ZAYA1-8B shapes (docs/shapes.md letters): D hidden, E experts (+1 skip class), F expert FFN,
# R router latent, Hq/Hk/d heads, k0/k1 CCA kernel sizes, rotary_dim = d / 2, V vocabulary.
ZAYA1 = dict(D=2048, E=16, F=2048, R=256, HQ=8, HK=2, HEAD_DIM=128, K0=2, K1=2, ROTARY=64, V=262_272)
TOKENS = 4096  # T of a microbatch
CUDA = torch.device("cuda")
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


@dataclasses.dataclass(frozen=True)
class Driver:
    op: str
    label: str  # dtypes / mode, and for a test shape the test it comes from
    run: Callable[[], None]
    production: bool  # the ZAYA1-8B shapes (spills are checked there), not a test's
    trainer: bool  # the trainer's dtype path: bf16 parameters, fp32 hidden states into lm_logprobs


def _meta(*shape: int, dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def _backward(outputs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> None:
    outs = [o for o in outputs if o is not None and o.requires_grad]
    # retain_graph: a driver may take several backwards of one graph (meta tensors: nothing is held)
    torch.autograd.grad(outs, [i for i in inputs if i.requires_grad], [torch.empty_like(o) for o in outs],
                        allow_unused=True, retain_graph=True)


def drive_experts(dtype: torch.dtype, t: int = TOKENS, d: int = ZAYA1["D"], f: int = ZAYA1["F"],
                  e: int = ZAYA1["E"], config=None) -> None:
    """Forward + backward, then the no-grad forward (SAVE_GU=False)."""
    from zrl.modeling.kernels.experts.triton_kernel import KernelConfig, moe_experts_triton

    cfg = config or KernelConfig.for_device(CUDA, dtype)
    x = _meta(t, d, dtype=dtype, grad=True)
    ids = _meta(t, dtype=torch.int64)
    gate = _meta(t, dtype=fp32, grad=True)
    w_gu = _meta(e, 2 * f, d, dtype=dtype, grad=True)
    w_down = _meta(e, d, f, dtype=dtype, grad=True)
    _backward((moe_experts_triton(x, ids, gate, w_gu, w_down, config=cfg),), [x, gate, w_gu, w_down])
    with torch.no_grad():
        moe_experts_triton(x, ids, gate, w_gu, w_down, config=cfg)


def drive_experts_glue(x_dtype: torch.dtype, w_dtype: torch.dtype, t: int = TOKENS, d: int = ZAYA1["D"],
                       f: int = ZAYA1["F"]) -> None:
    """grouped_mm.py's fused glue (glue.py), forward + backward: x into the weights' dtype, the SwiGLU of
    the gate_up GEMM's rows, the down output (weights' dtype) back to token order with the gate, fp32."""
    from zrl.modeling.kernels.experts import glue

    x, gate = _meta(t, d, dtype=x_dtype, grad=True), _meta(t, dtype=fp32, grad=True)
    order, n = _meta(t, dtype=torch.int64), _meta(1, dtype=torch.int32)
    _backward((glue.permute(x, order, n, w_dtype),), [x])
    gu = _meta(t, 2 * f, dtype=w_dtype, grad=True)
    _backward((glue.swiglu(gu, n),), [gu])
    y_sorted = _meta(t, d, dtype=w_dtype, grad=True)
    _backward((glue.unpermute_scale(y_sorted, gate, order, n),), [y_sorted, gate])


def drive_router(dtype: torch.dtype, t: int = TOKENS, r: int = ZAYA1["R"], c: int = ZAYA1["E"] + 1,
                 replay: bool = True, **blocks) -> None:
    """Forward (no replay) + backward, and with `replay` the replay variant of the forward; `blocks`:
    the launcher's block_t / block_k (its defaults otherwise)."""
    from zrl.moepp.kernels.router.triton_kernel import route

    # norm weight, fc1 weight/bias, fc2 weight/bias, out weight
    weights = [_meta(*shape, dtype=dtype, grad=True) for shape in ((r,), (r, r), (r,), (r, r), (r,), (c, r))]
    x = _meta(t, r, dtype=dtype, grad=True)
    bias = _meta(c, dtype=fp32)
    gate, _, _ = route(x, *weights, bias, None, 1e-6, **blocks)
    _backward((gate,), [x, *weights])
    if replay:
        route(x, *weights, bias, _meta(t, dtype=torch.int64), 1e-6, **blocks)


def drive_residual_norm(dtype: torch.dtype, t: int = TOKENS, d: int = ZAYA1["D"], param_dtype=None,
                        modes: tuple[str, ...] = ("add_norm", "add", "norm"), single_outputs: bool = False,
                        **blocks) -> None:
    """Forward + backward of `modes`: "add_norm" (scaling + norm), "add" (scaling alone), "norm"
    (rms_norm of the fp32 stream, as the model's norms: its output fp32, as the final norm's, and bf16, as the
    input norm's), the residual in fp32 as in the model; with `single_outputs` also add_norm's backward
    of x alone and of normed alone."""
    from zrl.modeling.kernels.residual_norm.triton_kernel import rms_norm, scaled_residual_add_rmsnorm

    param_dtype = param_dtype or dtype
    branch = _meta(t, d, dtype=dtype, grad=True)
    residual = _meta(t, d, dtype=fp32, grad=True)
    params = [_meta(d, dtype=param_dtype, grad=True) for _ in range(5)]
    leaves = [branch, residual, *params]
    if "add_norm" in modes:
        x, normed = scaled_residual_add_rmsnorm(branch, residual, *params, 1e-6, **blocks)
        _backward((x, normed), leaves)
        if single_outputs:
            _backward((x,), leaves)
            _backward((normed,), leaves)
    if "add" in modes:
        x, _ = scaled_residual_add_rmsnorm(branch, residual, *params[:4], None, 0.0, **blocks)
        _backward((x,), leaves[:6])
    if "norm" in modes:
        for out_dtype in (None, bf16):
            _backward((rms_norm(residual, params[4], 1e-6, out_dtype, **blocks),), [residual, params[4]])


def drive_rms_norm(dtype: torch.dtype, t: int, d: int, weight_dtype=fp32, out_dtype=None) -> None:
    from zrl.modeling.kernels.residual_norm.triton_kernel import rms_norm

    x, w = _meta(t, d, dtype=dtype, grad=True), _meta(d, dtype=weight_dtype, grad=True)
    _backward((rms_norm(x, w, 1e-5, out_dtype),), [x, w])


def drive_cca(dtype: torch.dtype, t: int = TOKENS, hq: int = ZAYA1["HQ"], hk: int = ZAYA1["HK"],
              d: int = ZAYA1["HEAD_DIM"], k0: int = ZAYA1["K0"], k1: int = ZAYA1["K1"],
              rotary: int = ZAYA1["ROTARY"], param_dtype=None, **blocks) -> None:
    """Forward + backward; conv parameters in `param_dtype` (the compute dtype by default: the launcher
    casts them to fp32, an autograd op)."""
    from zrl.moepp.kernels.cca.triton_kernel import cca_precondition

    param_dtype = param_dtype or dtype
    c = (hq + hk) * d
    q = _meta(t, hq * d, dtype=dtype, grad=True)
    k = _meta(t, hk * d, dtype=dtype, grad=True)
    params = [_meta(c, 1, k0, dtype=param_dtype, grad=True), _meta(c, dtype=param_dtype, grad=True),
              _meta(c, d, k1, dtype=param_dtype, grad=True), _meta(c, dtype=param_dtype, grad=True),
              _meta(hk, dtype=param_dtype, grad=True)]
    rope = [_meta(t, rotary // 2, dtype=fp32) for _ in range(2)]
    q_out, k_out = cca_precondition(q, k, *params, _meta(t, dtype=torch.int64), *rope, hq, hk, d, **blocks)
    _backward((q_out, k_out), [q, k, *params])


def drive_lm_logprobs(hidden_dtype: torch.dtype, weight_dtype: torch.dtype, t: int = TOKENS,
                      d: int = ZAYA1["D"], v: int = ZAYA1["V"], floor: bool = False, config=None) -> None:
    """Without and with entropy, forward + backward, through the public launcher with the CUDA tiles
    (or `config`); `floor`: with a per-token logit floor."""
    from zrl.modeling.kernels.lm_logprobs import triton_kernel as lm

    hidden = _meta(t, d, dtype=hidden_dtype, grad=True)
    weight = _meta(v, d, dtype=weight_dtype, grad=True)
    if config is None:
        parts = 1 if lm.native_16bit(hidden, weight) else 3
        config = lm.default_config(CUDA, parts)
    floor_t = _meta(t, dtype=fp32) if floor else None
    for with_entropy in (False, True):
        logprob, entropy = lm.token_logprobs_triton(hidden, weight, _meta(t, dtype=torch.int64),
                                                    with_entropy=with_entropy, floor=floor_t, config=config)
        _backward((logprob, entropy) if with_entropy else (logprob,), [hidden, weight])


def drive_lm_head_grad_parts(with_entropy: bool, c: int = 1024, v: int = ZAYA1["V"]) -> None:
    """The fused head loss's gradient-parts pass (lm_logprobs/grad_parts_kernel.py) on one chunk of the
    library formulation's size (c = 1024 at V = 262,272), writing the parts the trainer's products read
    (fp32 hidden, bf16 W: `FusedSplitProducts.grad_sequence` at its default orders)."""
    from zrl.modeling.kernels.lm_logprobs.fused import FusedSplitProducts
    from zrl.modeling.kernels.lm_logprobs.grad_parts_kernel import grad_parts

    sequence = FusedSplitProducts(_meta(c, ZAYA1["D"], dtype=fp32), _meta(v, ZAYA1["D"], dtype=bf16)).grad_sequence
    row = _meta(c, dtype=fp32)
    grad_parts(_meta(c, v, dtype=fp32), row, _meta(c, dtype=torch.int64), row, row if with_entropy else None,
               row if with_entropy else None, sequence)


def drive_lm_head_row_stats(with_entropy: bool, c: int = 1024, v: int = ZAYA1["V"]) -> None:
    """The fused head loss's log-sum-exp and entropy pass (lm_logprobs/grad_parts_kernel.py) on one chunk."""
    from zrl.modeling.kernels.lm_logprobs.grad_parts_kernel import row_stats

    row_stats(_meta(c, v, dtype=fp32), with_entropy)


def _production() -> list[Driver]:
    """bf16 is the training dtype; fp32 wherever the launcher takes it."""
    def prod(op, label, run, trainer=False):
        return Driver(op, label, run, production=True, trainer=trainer)

    return [
        prod("experts", "bf16", lambda: drive_experts(bf16), trainer=True),
        prod("experts", "fp32", lambda: drive_experts(fp32)),
        prod("experts", "glue bf16", lambda: drive_experts_glue(bf16, bf16), trainer=True),
        prod("router", "bf16", lambda: drive_router(bf16), trainer=True),
        prod("router", "fp32", lambda: drive_router(fp32)),
        prod("residual_norm", "bf16 branch+params", lambda: drive_residual_norm(bf16), trainer=True),
        prod("residual_norm", "bf16 branch+params, pipelined", lambda: drive_residual_norm(
            bf16, stages=_residual_norm_pipelined()), trainer=True),
        prod("residual_norm", "fp32", lambda: drive_residual_norm(fp32)),
        prod("cca", "bf16 q/k", lambda: drive_cca(bf16), trainer=True),
        prod("cca", "fp32 q/k", lambda: drive_cca(fp32)),
        prod("lm_logprobs", "fp32 hidden, bf16 W", lambda: drive_lm_logprobs(fp32, bf16), trainer=True),
        prod("lm_logprobs", "fp32 hidden, bf16 W, floor", lambda: drive_lm_logprobs(fp32, bf16, floor=True),
             trainer=True),
        prod("lm_logprobs", "bf16 hidden+W", lambda: drive_lm_logprobs(bf16, bf16)),
        prod("lm_logprobs", "fused head: G parts", lambda: drive_lm_head_grad_parts(False), trainer=True),
        prod("lm_logprobs", "fused head: G parts, entropy term", lambda: drive_lm_head_grad_parts(True)),
        prod("lm_logprobs", "fused head: lse", lambda: drive_lm_head_row_stats(False), trainer=True),
        prod("lm_logprobs", "fused head: lse, entropy", lambda: drive_lm_head_row_stats(True), trainer=True),
    ]


# The CUDA cases of the tests, as (label, keyword arguments of the op's driver). Labels name the test.
def _experts_cases() -> list[tuple[str, dict]]:
    from zrl.modeling.kernels.experts import test_experts
    from zrl.modeling.kernels.experts.triton_kernel import KernelConfig

    shapes = [*test_experts.SHAPES,  # (T, D, F, E) of test_parity_random_routing
        (40, 32, 48, 4), (64, 32, 48, 4), (2, 32, 48, 4),  # test_parity_edge_routing
        (33, 16, 32, 3),  # test_all_tokens_skipped
        (2, 1, 1, 1),  # test_hand_computed_single_feature
        (33, 32, 16, 3),  # test_gate_grad_is_dot_of_dy_and_unscaled_output
        (64, 32, 32, 3),  # test_deterministic
        (256, 64, 96, 4),  # test_no_host_sync_cuda
    ]
    cases = [(f"test T={t} D={d} F={f} E={e}", dict(dtype=fp32, t=t, d=d, f=f, e=e)) for t, d, f, e in shapes]
    small = KernelConfig(block_m=32, block_n=32, block_k=16, block_r=32, num_warps=4, num_stages=2)
    cases.append(("test_other_tile_sizes", dict(dtype=fp32, t=64, d=48, f=48, e=3, config=small)))
    cases.append(("test_bf16_error", dict(dtype=bf16, t=512, d=256, f=192, e=4)))
    return cases


def _experts_glue_cases() -> list[tuple[str, dict]]:
    """The CUDA tests of grouped_mm.py with `fused_glue`: their (T, D, F) in fp32, and the bf16 one."""
    from zrl.modeling.kernels.experts import test_experts

    sizes = {(t, d, f) for t, d, f, _ in test_experts.SHAPES} | {(40, 32, 48), (64, 32, 48), (2, 32, 48),
                                                                 (33, 32, 48), (33, 32, 16)}
    cases = [(f"test_grouped_mm T={t} D={d} F={f}", dict(x_dtype=fp32, w_dtype=fp32, t=t, d=d, f=f))
             for t, d, f in sorted(sizes)]
    cases.append(("test_fused_glue_bf16_gpu", dict(x_dtype=bf16, w_dtype=bf16, t=512, d=256, f=192)))
    return cases


def _router_cases() -> list[tuple[str, dict]]:
    from zrl.moepp.kernels.router import test_router

    small = dict(block_t=16, block_k=16)
    cases = [(f"test T={t} R={r} C={c}", dict(dtype=fp32, t=t, r=r, c=c, replay=False, **small))
             for t, r, c in test_router.SHAPES]  # test_parity_forward_backward
    cases += [
        ("test_default_blocks", dict(dtype=fp32, t=37, r=32, c=17, replay=False)),
        ("test_replay", dict(dtype=fp32, t=37, r=32, c=5, **small)),
        ("test_replay_forcing_the_skip_class", dict(dtype=fp32, t=21, r=16, c=5, **small)),
        ("test_ties", dict(dtype=fp32, t=19, r=16, c=4, replay=False, **small)),
        ("test_softmax_gather_gradient", dict(dtype=fp32, t=5, r=16, c=3, replay=False, **small)),
        ("test_model_router (tiny config)", dict(dtype=fp32, t=37, r=32, c=5)),
        ("test_bf16_parity_on_gpu", dict(dtype=bf16, t=4096, r=256, c=17)),
    ]
    cases += [(f"test_fp16 T={t} R={r} C={c}", dict(dtype=fp16, t=t, r=r, c=c, **small))
              for t, r, c in [(5, 32, 17), (37, 32, 2), (37, 48, 5)]]
    return cases


def _residual_norm_pipelined() -> int:
    from zrl.modeling.kernels.residual_norm.triton_kernel import PIPELINED_STAGES

    return PIPELINED_STAGES


def _residual_norm_cases() -> list[tuple[str, Callable[[], None]]]:
    both = ("add_norm", "add")  # the tests' `norm` parameter: with and without the norm weight
    cases = []
    for t in (1, 3, 37):  # test_parity_forward_backward: default tiles, then block_t 4 pipelined
        for d in (16, 48, 64, 100):
            cases.append((f"test T={t} D={d}", functools.partial(drive_residual_norm, fp32, t, d, modes=both)))
            cases.append((f"test T={t} D={d} block_t=4", functools.partial(
                drive_residual_norm, fp32, t, d, modes=both, block_t=4, num_partials=3, stages=2)))
    add_norm = functools.partial(drive_residual_norm, modes=("add_norm",))
    cases += [
        ("test_fp16_branch", functools.partial(drive_residual_norm, fp16, 37, 100, param_dtype=fp32, modes=both,
                                               block_t=8, num_partials=3)),
        ("test_one_output_used", functools.partial(add_norm, fp32, 9, 48, single_outputs=True, block_t=2,
                                                   num_partials=2)),
        ("test_modules_fused_call", functools.partial(add_norm, fp32, 5, 48)),
        ("test_all_zero_row", functools.partial(add_norm, fp32, 3, 48, single_outputs=True)),
        ("test_constant_rows", functools.partial(add_norm, fp32, 5, 100)),
        ("test_scaling_hand_computed", functools.partial(add_norm, fp32, 1, 2, single_outputs=True)),
        ("test_eps_and_magnitudes", functools.partial(add_norm, fp32, 12, 64, block_t=4, num_partials=2)),
        *((f"test_bf16_gpu D={d} stages={n}", functools.partial(add_norm, bf16, 517, d, stages=n))
          for d in (100, 2048) for n in (1, 3)),
    ]
    cases += [(f"test_rms_norm {t}x{d} {str(dt)[6:]}", functools.partial(drive_rms_norm, dt, t, d))
              for t, d, dt in [(1, 16, fp32), (37, 100, fp32), (10, 48, fp32), (9, 64, fp16)]]
    cases.append(("test_rms_norm_bf16_output", functools.partial(drive_rms_norm, fp32, 37, 100, out_dtype=bf16)))
    return cases


def _cca_cases() -> list[tuple[str, dict]]:
    from zrl.moepp.kernels.cca import test_cca

    small = dict(test_cca.SMALL)
    ragged = sum(test_cca.RAGGED)
    cases = [(f"test d={d} Hq/Hk={hq}/{hk} k={k0},{k1} rot={rot}",
              dict(dtype=fp32, t=ragged, hq=hq, hk=hk, d=d, k0=k0, k1=k1, rotary=rot, **small))
             for d, hq, hk, k0, k1, rot in test_cca.CASES]
    ragged_docs = dict(dtype=fp32, hq=4, hk=2, d=32, k0=3, k1=2, rotary=16)
    cases += [(f"test_ragged_documents T={t}", dict(ragged_docs, t=t, **blocks))
              for t in (20, 18, 5, 19) for blocks in (small, {})]  # both tile sets per case
    # bf16 weights: the split GEMMs (their taps and epilogue kernels in the bit-pattern variants)
    cases += [(f"test_split_gemms d={d} Hq/Hk={hq}/{hk} k={k0},{k1} rot={rot}",
               dict(dtype=fp32, t=sum(lens), hq=hq, hk=hk, d=d, k0=k0, k1=k1, rotary=rot, param_dtype=bf16, **small))
              for lens, (d, hq, hk, k0, k1, rot) in test_cca.SPLIT_CASES]
    no_leakage = dict(dtype=fp32, t=24, hq=2, hk=1, d=32, k0=3, k1=2, rotary=32, **small)
    cases += [
        ("test_no_leakage", no_leakage),
        ("test_no_leakage bf16 weights", dict(no_leakage, param_dtype=bf16)),
        ("test_attention_block", dict(dtype=fp32, t=11, hq=4, hk=2, d=16, k0=3, k1=2, rotary=8)),
        ("test_bf16_projections_gpu", dict(dtype=bf16, t=128, hq=8, hk=2, d=128, k0=2, k1=2, rotary=64,
                                           param_dtype=fp32)),
        ("test_trainer_dtypes_gpu", dict(dtype=bf16, t=128, hq=8, hk=2, d=128, k0=2, k1=2, rotary=64)),
    ]
    return cases


def _lm_logprobs_cases() -> list[tuple[str, dict]]:
    from zrl.modeling.kernels.lm_logprobs.triton_kernel import TileConfig

    cases = [(f"test T={t} D={d} V={v}", dict(hidden_dtype=fp32, weight_dtype=fp32, t=t, d=d, v=v))
             for t in (1, 9, 40) for d in (16, 48) for v in (10, 64, 100)]  # test_parity_forward_backward
    cases += [(f"test_vocabulary_splits {k}", dict(hidden_dtype=fp32, weight_dtype=fp32, t=20, d=48, v=100,
                                                    config=TileConfig(16, 16, 16, vocab_splits=k)))
              for k in (1, 2, 4)]
    cases += [
        ("test_fp16_inputs", dict(hidden_dtype=fp16, weight_dtype=fp16, t=40, d=48, v=100)),
        ("test_fp32_hidden_with_bf16_weight", dict(hidden_dtype=fp32, weight_dtype=bf16, t=40, d=48, v=100)),
        ("test_bf16_inputs_gpu", dict(hidden_dtype=bf16, weight_dtype=bf16, t=300, d=256, v=1000)),
        ("test_logit_floor", dict(hidden_dtype=fp32, weight_dtype=fp32, t=40, d=48, v=100, floor=True)),
        ("test_logit_floor_of_minus_infinity", dict(hidden_dtype=fp32, weight_dtype=fp32, t=20, d=16, v=64,
                                                    floor=True)),
        ("test_hand_computed_values", dict(hidden_dtype=fp32, weight_dtype=fp32, t=1, d=16, v=2)),
        ("test_uniform_logits_hand_values", dict(hidden_dtype=fp32, weight_dtype=fp32, t=2, d=16, v=100)),
        ("test_fp32_level_accuracy", dict(hidden_dtype=fp32, weight_dtype=bf16, t=8, d=2048, v=262_272)),
    ]
    return cases


def _test_shapes() -> list[Driver]:
    def test(op, label, run, trainer=False):
        return Driver(op, label, run, production=False, trainer=trainer)

    drivers = [test("experts", label, functools.partial(drive_experts, **kw), kw["dtype"] == bf16)
               for label, kw in _experts_cases()]
    drivers += [test("experts", label, functools.partial(drive_experts_glue, **kw), kw["w_dtype"] == bf16)
                for label, kw in _experts_glue_cases()]
    drivers += [test("router", label, functools.partial(drive_router, **kw), kw["dtype"] == bf16)
                for label, kw in _router_cases()]
    drivers += [test("residual_norm", label, run) for label, run in _residual_norm_cases()]
    drivers += [test("cca", label, functools.partial(drive_cca, **kw), kw["dtype"] == bf16)
                for label, kw in _cca_cases()]
    drivers += [test("lm_logprobs", label, functools.partial(drive_lm_logprobs, **kw),
                     kw["hidden_dtype"] == fp32 and kw["weight_dtype"] == bf16)
                for label, kw in _lm_logprobs_cases()]
    return drivers


def drivers(tests: bool = True) -> list[Driver]:
    """The production drivers, then (with `tests`) those of the tests' CUDA cases."""
    return _production() + (_test_shapes() if tests else [])


def token_drivers() -> dict[str, Callable[[int], None]]:
    """Per op, the trainer's launches at the ZAYA1-8B shapes for a token count T (the argument)."""
    def lm_logprobs(t: int) -> None:
        drive_lm_logprobs(fp32, bf16, t)
        drive_lm_logprobs(fp32, bf16, t, floor=True)
        # the fused head loss (the trainer's RL loss): chunks of 1024 tokens, the last one T mod 1024
        for c in {min(1024, t), t % 1024} - {0}:
            for with_entropy in (True, False):
                drive_lm_head_row_stats(with_entropy, c)
                drive_lm_head_grad_parts(with_entropy, c)

    return {
        # the glue: what grouped_mm.py launches with fused_glue (off until timed on a GPU)
        "experts": lambda t: (drive_experts(bf16, t), drive_experts_glue(bf16, bf16, t)),
        "router": lambda t: drive_router(bf16, t),
        "residual_norm": lambda t: drive_residual_norm(bf16, t),
        "cca": lambda t: drive_cca(bf16, t),
        "lm_logprobs": lm_logprobs,
    }
