"""Markovian RSA on a trained tiny policy: accuracy by round and the serving profile.

1. Accuracy table: a single rollout (round 0's mean correctness over its N candidates) against every
   aggregation round's mean correctness and majority vote, on an environment's held-out problems.
2. Serving profile, in the same process and engine: the wall-clock of Markovian RSA (every problem's
   candidates batched into one engine pass per round, prefill bounded by |q| + C tau + overhead) against
   one long rollout per problem that generates exactly as many tokens as RSA generated for it (EOS
   ignored), all problems batched. Alternating runs; the medians and their ratio RSA / long.

Run: .venv/bin/python bench/rsa_serving.py CHECKPOINT [--env strings] [--options '{tasks: copy}']
     [--problems 32] [-N 8] [-C 4] [-T 2] [--thinking-budget 24] [--tail-tokens 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _var, _sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("VLLM_CACHE_ROOT", "vllm"), ("TRITON_CACHE_DIR", "triton")):
    os.environ.setdefault(_var, str(ROOT / ".cache" / _sub))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # see bench/rollout_engine.py: two threads make CPU steps erratic


def long_rollouts(engine, prompter, problems, totals: list[int], temperature: float, seed: int) -> tuple[float, int]:
    """One rollout per problem of exactly totals[j] tokens, all in one engine pass -> (seconds, tokens)."""
    from serving.engine import SamplingConfig

    start = time.perf_counter()
    for j, problem in enumerate(problems):
        engine.submit(prompter.plain(problem), 1, SamplingConfig(max_tokens=totals[j], temperature=temperature,
                                                                 ignore_eos=True), seed=seed + j)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(s.output.token_ids) for s in engine.step())
    return time.perf_counter() - start, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--env", default="strings")
    parser.add_argument("--options", default="{tasks: copy}", help="the environment's options (YAML)")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("-N", type=int, default=8)
    parser.add_argument("-C", type=int, default=4)
    parser.add_argument("-T", type=int, default=2)
    parser.add_argument("--thinking-budget", type=int, default=24)
    parser.add_argument("--tail-tokens", type=int, default=12)
    parser.add_argument("--answer-budget", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import yaml

    from zrl.runtime_env import apply_defaults

    apply_defaults()
    from serving.engine import RolloutEngine
    from serving.rsa import AggregationPrompter, RSAConfig, context_needed, run_markovian_rsa
    from zrl.config.schema import EnvironmentSpec
    from zrl.prompts import build_environment

    env = build_environment(EnvironmentSpec(name=args.env, options=yaml.safe_load(args.options) or {}))
    problems = env.sample(args.problems, seed=args.seed, split="eval")
    config = RSAConfig(num_candidates=args.N, num_aggregated=args.C, num_rounds=args.T,
                       thinking_budget=args.thinking_budget, tail_tokens=args.tail_tokens,
                       answer_budget=args.answer_budget, temperature=args.temperature, seed=args.seed)
    from transformers import AutoTokenizer

    prompter = AggregationPrompter(AutoTokenizer.from_pretrained(args.checkpoint))
    rsa_context = max(context_needed(prompter, config, p) for p in problems)
    most_tokens = config.num_candidates * (config.num_rounds + 1) * (config.thinking_budget + config.answer_budget)
    long_context = max(len(prompter.plain(p)) for p in problems) + most_tokens
    engine = RolloutEngine(args.checkpoint, dtype=args.dtype, max_model_len=max(rsa_context, long_context),
                           seed=args.seed)
    try:
        run_markovian_rsa(engine, problems[:2], config)  # warm-up: the engine's first passes compile
        rsa_seconds, long_seconds, result = [], [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = run_markovian_rsa(engine, problems, config, verifier=env)
            rsa_seconds.append(time.perf_counter() - start)
            totals = [sum(r.generated_tokens for r in p.rounds) for p in result.problems]
            seconds, generated = long_rollouts(engine, prompter, problems, totals, args.temperature, args.seed)
            assert generated == sum(totals), (generated, sum(totals))
            long_seconds.append(seconds)
    finally:
        engine.close()

    print(f"checkpoint {args.checkpoint}; env {args.env} {args.options}; {len(problems)} held-out problems, "
          f"seed {args.seed}; N={config.num_candidates} C={config.num_aggregated} T={config.num_rounds} "
          f"beta={config.thinking_budget} tau={config.tail_tokens} answer_budget={config.answer_budget} "
          f"temperature={config.temperature}")
    print(f"\n{'round':>5}  {'mean correct':>12}  {'majority':>8}  {'tokens/problem':>14}  {'max prefill':>11}")
    for r in range(config.num_rounds + 1):
        s = result.round_summary(r)
        print(f"{r:>5}  {s['mean_reward']:>12.3f}  {s['majority_accuracy']:>8.3f}  "
              f"{s['total_generated_tokens_per_problem']:>14.1f}  {s['max_prefill']:>11}")
    print(f"single rollout (round 0, mean over {len(problems)} x {config.num_candidates} samples): "
          f"{result.round_summary(0)['mean_reward']:.3f}")
    rsa, long = statistics.median(rsa_seconds), statistics.median(long_seconds)
    tokens = sum(sum(r.generated_tokens for r in p.rounds) for p in result.problems)
    print(f"\nserving profile, {tokens} generated tokens each side ({args.repeats} alternating runs):")
    print(f"  Markovian RSA: median {rsa:.2f} s {[round(s, 2) for s in rsa_seconds]}")
    print(f"  one long rollout per problem: median {long:.2f} s {[round(s, 2) for s in long_seconds]}")
    print(f"  ratio RSA / long: {rsa / long:.2f}x")


if __name__ == "__main__":
    main()
