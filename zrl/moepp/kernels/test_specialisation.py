"""A token count that changes every step compiles no new kernel variant.

Triton compiles one binary per specialisation of a launch's arguments: besides dtypes and constexprs, an
integer argument is specialised on being divisible by 16 and on being 1, unless the kernel marks it
`do_not_specialize`. A training run's token count T differs at every step, so a kernel specialised on
T would compile (and cache, and bind) up to three variants of itself. This test drives every launcher
on the trainer's path at the ZAYA1-8B shapes (sm90_drivers.token_drivers) over 20 token counts and
computes each launch's specialisation key with the runtime's own binder (sm90_check.specialise:
no GPU, nothing compiled), then asserts that each kernel has exactly the variants its switches give at
one token count. Measured over these 20 counts before the kernels took T with `do_not_specialize`:
twice the variants of every kernel taking T (T % 16 == 0 and not; e.g. router._route_fwd 4 instead of
2, residual_norm 6 instead of 3, lm_logprobs._forward_kernel 16 instead of 4, the extra ones there also
from the 16-byte alignment of [T]-row views of one allocation); now as many as at one count.

It runs in a subprocess without TRITON_INTERPRET: this folder's conftest sets it for the pytest
process, and a kernel decorated under it is an interpreted function with no binder.
"""

import json
import os
import subprocess
import sys

# 1000..1015 (one multiple of 16: 1008) and multiples of 16 up to a production microbatch.
TOKEN_COUNTS = [*range(1000, 1016), 1024, 2048, 4096, 8192]
ONE_COUNT = [4096]

_SCRIPT = """
import json, sys
from zrl.moepp.kernels import sm90_check
from zrl.modeling.kernels.lm_logprobs import triton_kernel as lm
from zrl.moepp.kernels.sm90_drivers import token_drivers

lm._sm_count = lambda index: 132  # an H100's SMs: the vocabulary splits a GPU would take for each T
out = {}
for op, drive in token_drivers().items():
    for label, counts in (("varying", json.loads(sys.argv[1])), ("one", json.loads(sys.argv[2]))):
        for kernel, keys in sm90_check.specialisations(drive, counts).items():
            out.setdefault(kernel, {})[label] = len(keys)
json.dump(out, sys.stdout)
"""


def test_token_counts_compile_no_new_variants():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(TOKEN_COUNTS), json.dumps(ONE_COUNT)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout)
    ops = {kernel.split(".")[0] for kernel in counts}
    assert ops == {"experts", "router", "residual_norm", "cca", "lm_logprobs"}, counts
    extra = {kernel: c for kernel, c in counts.items() if c["varying"] != c["one"]}
    assert not extra, f"variants over {len(TOKEN_COUNTS)} token counts vs at one: {extra}"
