"""Fused kernels of MoE++'s own ops: the CCA preconditioner (cca/) and the router with a skip class
(router/), each with its PyTorch reference, Triton kernel, parity test and README, dispatched through
the backend switch of zrl.modeling.kernels (which holds the shared ops and explains the layout). The
sm90 compile check covers every kernel of both packages.
"""
