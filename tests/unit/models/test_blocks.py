"""zrl.modeling.blocks.linears: several projections of one input as one GEMM, or one by one."""

import torch
from torch import nn

from zrl.modeling.blocks import linears
from zrl.modeling.kernels.gemm_count import GemmCounter


def _layers(bias: tuple[bool, ...], seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(16, out, bias=b) for out, b in zip((8, 4, 4), bias)]


def test_plain_linears_run_as_one_gemm_with_the_layers_values():
    layers = _layers((True, True, True))
    x = torch.randn(5, 16, dtype=torch.float64)  # cast once to the weights' fp32
    with GemmCounter() as gemms:
        outs = linears(x, layers)
    assert gemms.total_launches == 1
    for out, layer in zip(outs, layers):
        assert out.dtype == torch.float32 and out.shape == (5, layer.out_features)
        torch.testing.assert_close(out, layer(x.float()), rtol=1e-6, atol=1e-6)


def test_mixed_biases_run_one_by_one():
    layers = _layers((True, False, True))
    x = torch.randn(5, 16)
    with GemmCounter() as gemms:
        outs = linears(x, layers)
    assert gemms.total_launches == 3
    assert all(torch.equal(out, layer(x)) for out, layer in zip(outs, layers))
