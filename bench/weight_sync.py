"""Weight sync: the collective stream (gloo here, NCCL on GPUs) vs the object-store state dict, same run.

For each model size: 2 FSDP2 trainer ranks and 2 rollout workers (vLLM engines) as Ray actors, the
same paths the RL stage uses (zrl.pipeline.trainer_rank / rollout_worker). Per path: wall seconds of
one sync (median of --repeats), bytes/s, and the peak memory above the level before the sync in the
sending trainer rank (collective: measured there; object store: the whole state dict is built there,
at least the model's size) and in the receiving workers.

    .venv/bin/python bench/weight_sync.py [--repeats 3] [--bucket-mib 2]
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTLIB = ROOT / "tests" / "integration" / "pipeline"
SIZES = {"20 MiB": dict(hidden_size=256, moe_intermediate_size=192, num_hidden_layers=8),
         "80 MiB": dict(hidden_size=512, moe_intermediate_size=384, num_hidden_layers=8),
         "180 MiB": dict(hidden_size=768, moe_intermediate_size=576, num_hidden_layers=8),
         # deeper, not wider: layers keep their size, so a bounded receiver keeps its peak
         "45 MiB deep": dict(hidden_size=256, moe_intermediate_size=192, num_hidden_layers=16),
         "90 MiB deep": dict(hidden_size=256, moe_intermediate_size=192, num_hidden_layers=32)}


def bench_size(name: str, overrides: dict, args, workdir: Path) -> dict:
    import ray

    from pipeline_testlib import recipe_data
    from sync_testlib import form_group, start_trainers, start_workers, sync_collective, sync_object_store
    from zrl.assets import build_tiny_model
    from zrl.config import parse_recipe
    from zrl.pipeline.controller import trainer_settings
    from zrl.pipeline.pools import reserve_pools

    model_dir = build_tiny_model(workdir / name.replace(" ", ""), seed=1, **overrides)
    data = recipe_data(workdir, model_dir)
    data["resources"]["rollout_workers"] = 2
    recipe = parse_recipe(data)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    try:
        rollout_pool, trainer_pool = reserve_pools(recipe.resources)
        ranks = start_trainers(trainer_pool, model_dir, trainer_settings(recipe, recipe.stages[0]))
        workers = start_workers(rollout_pool, model_dir, recipe.stages[0], count=2)
        form_group(ranks, workers)
        bucket = int(args.bucket_mib * 2**20)
        collective = [sync_collective(ranks, workers, "float32", bucket) for _ in range(args.repeats)]
        store = [sync_object_store(ranks, workers, "float32", version=0) for _ in range(args.repeats)]
    finally:
        ray.shutdown()
    median = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    model_bytes = collective[0]["bytes"]
    return {"size": name, "model_mib": model_bytes / 2**20,
            "collective_s": median(collective, "seconds"), "store_s": median(store, "seconds"),
            "collective_sender_mib": max(r["sender_peak"] for r in collective) / 2**20,
            "collective_receiver_mib": collective[0]["receiver_peak"] / 2**20,  # the engine's first reload
            "collective_receiver_later_mib": max(r["receiver_peak"] for r in collective[1:]) / 2**20,
            "store_receiver_mib": max(r["receiver_peak"] for r in store) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="syncs per path and size (at least 2)")
    parser.add_argument("--bucket-mib", type=float, default=2.0)
    parser.add_argument("--sizes", nargs="*", default=list(SIZES))
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats: at least 2 (the first sync is the engine's first reload, reported apart)")
    os.environ["PYTHONPATH"] = str(TESTLIB)
    sys.path.insert(0, str(TESTLIB))
    from zrl.runtime_env import apply_defaults

    apply_defaults()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zrl-bench-sync-") as tmp:
        for name in args.sizes:
            rows.append(bench_size(name, SIZES[name], args, Path(tmp)))
    sys.stdout.write(f"bucket {args.bucket_mib:g} MiB, 2 trainer ranks -> 2 rollout workers, fp32, median of "
                     f"{args.repeats}\n")
    for r in rows:
        mb = r["model_mib"]
        sys.stdout.write(
            f"model {mb:6.1f} MiB | collective {r['collective_s']:6.3f} s ({mb / r['collective_s']:6.1f} MiB/s) | "
            f"object store {r['store_s']:6.3f} s ({mb / r['store_s']:6.1f} MiB/s) | store/collective time "
            f"{r['store_s'] / r['collective_s']:.2f}x | peak extra MiB: collective sender "
            f"{r['collective_sender_mib']:.1f} receiver {r['collective_receiver_mib']:.1f} (first) "
            f"{r['collective_receiver_later_mib']:.1f} (later), object-store receiver "
            f"{r['store_receiver_mib']:.1f}\n")


if __name__ == "__main__":
    main()
