"""TrainerWorker with `lora` on a 1-rank gloo group (in process): the base frozen in param_dtype and out of
the optimizer, the adapters starting at B = 0, a step moving only them, the merged export and the PEFT
directory agreeing, a checkpoint holding the adapters and their optimizer state, not the base, and
`zrl export` merging such a checkpoint into its base."""

import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from zrl.checkpoint_export import export_checkpoint
from zrl.config.schema import Algorithm, DPPOBinaryTV, LoRASpec, MuonSpec, Optimizer
from zrl.models import get_family
from zrl.modeling.lora import apply_lora, is_adapter, load_peft_adapter, merged_state_dict
from zrl.moepp import load_hf_checkpoint
from zrl.trainer import TrainerSettings, TrainerWorker
from zrl.trainer.synthetic import synthetic_train_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*returned a view tensor")
LORA = LoRASpec(rank=4, alpha=8.0)


def settings(**overrides):
    base = dict(param_dtype="float32", token_budget=40, max_response_tokens=40, lora=LORA,
                optimizer=Optimizer(muon=MuonSpec(lr=1e-2), grad_clip_norm=0.5),
                algorithm=Algorithm(trust_region=DPPOBinaryTV(delta=2e-4), router_bias_update=False))
    base.update(overrides)
    return TrainerSettings(**base)


def make_batch(model, trainer_step=0, seed=3):
    cfg = model.config
    return synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg), num_groups=3,
                                 group_size=4, trainer_step=trainer_step, seed=seed, model=model, logprob_noise=0.2)


def full(worker):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in worker.model.state_dict().items()}


def exported(worker):
    return {k: t.clone() for b in worker.export_weights(dtype=None, bucket_bytes=1 << 16) for k, t in b.tensors}


@pytest.fixture(scope="module")
def stepped(tiny_checkpoint, single_rank, tmp_path_factory):
    """A LoRA worker after one RL step, with its checkpoint and exports."""
    ref = load_hf_checkpoint(tiny_checkpoint)
    worker = TrainerWorker(single_rank, tiny_checkpoint, settings())
    start, start_export = full(worker), exported(worker)
    metrics = worker.train_step(worker.share_of(make_batch(ref)))
    root = tmp_path_factory.mktemp("trainer_lora")
    worker.save_checkpoint(root / "ckpt", data_state={"at": 1})
    worker.export_adapter(root / "adapter")
    return dict(ref=ref, worker=worker, start=start, start_export=start_export, metrics=metrics, root=root,
                after=full(worker), after_export=exported(worker))


def test_base_is_frozen_and_only_adapters_are_optimised(stepped):
    worker = stepped["worker"]
    optimised = {id(p) for g in worker.optimizer.param_groups for p in g["params"]}
    for name, param in worker.model.named_parameters():
        assert (id(param) in optimised) == is_adapter(name) == param.requires_grad, name
    assert any(is_adapter(n) for n, _ in worker.model.named_parameters())


def test_adapters_start_at_the_base_and_a_step_moves_only_them(stepped):
    start, after = stepped["start"], stepped["after"]
    base_names = [k for k in start if not is_adapter(k)]
    assert all(torch.equal(start[k], after[k]) for k in base_names)
    moved = [k for k in start if is_adapter(k) and not torch.equal(start[k], after[k])]
    assert any(k.endswith("lora_B") for k in moved)
    assert all(after[k].abs().sum() > 0 for k in start if k.endswith("lora_A"))
    ref_state = stepped["ref"].state_dict()  # B = 0: the merged export at the start is the base, bitwise
    names = get_family("zaya").hf_names
    for name, tensor in ref_state.items():
        for key, part in names.hf_tensors(name, tensor):
            assert torch.equal(stepped["start_export"][key], part), key
    assert stepped["metrics"]["optim/version"] == 1.0


def test_merged_export_equals_the_adapter_directory_merged(stepped, tiny_checkpoint):
    model = load_hf_checkpoint(tiny_checkpoint)
    apply_lora(model, LORA)
    load_peft_adapter(model, stepped["root"] / "adapter")
    names = get_family("zaya").hf_names
    expected = {key: part for name, t in merged_state_dict(model).items() for key, part in names.hf_tensors(name, t)}
    assert expected.keys() == stepped["after_export"].keys()
    for key, tensor in expected.items():
        assert torch.equal(stepped["after_export"][key], tensor), key
    assert any(not torch.equal(stepped["after_export"][k], stepped["start_export"][k]) for k in expected)


def test_checkpoint_holds_adapters_and_optimizer_state_not_the_base(stepped, single_rank, tiny_checkpoint):
    saved = FileSystemReader(str(stepped["root"] / "ckpt")).read_metadata().state_dict_metadata.keys()
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    params = {n for n, _ in stepped["worker"].model.named_parameters()}
    assert {k for k in model_keys if k in params} == {n for n in params if is_adapter(n)}
    assert any(k.startswith("optimizer.state.") and "lora_B" in k for k in saved)
    resumed = TrainerWorker(single_rank, tiny_checkpoint, settings())
    assert resumed.load_checkpoint(stepped["root"] / "ckpt") == {"at": 1}
    restored = full(resumed)
    assert all(torch.equal(restored[k], v) for k, v in stepped["after"].items())
    # the same next step from the original and the resumed worker: the AdamW moments came back too
    batch = make_batch(stepped["ref"], trainer_step=1, seed=4)
    stepped["worker"].train_step(stepped["worker"].share_of(batch))
    resumed.train_step(resumed.share_of(batch))
    a, b = full(stepped["worker"]), full(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bfloat16_base_is_kept_in_bfloat16_with_fp32_adapters(tiny_checkpoint, single_rank):
    """FSDP2 shards bf16 base and fp32 adapters in one unit (gathered in bf16, reduced in fp32)."""
    worker = TrainerWorker(single_rank, tiny_checkpoint, settings(param_dtype="bfloat16"))
    for name, param in worker.model.named_parameters():
        assert param.dtype == (torch.float32 if is_adapter(name) else torch.bfloat16), name
    start = full(worker)
    metrics = worker.train_step(worker.share_of(make_batch(load_hf_checkpoint(tiny_checkpoint))))
    after = full(worker)
    assert all(torch.equal(start[k], after[k]) for k in start if not is_adapter(k))
    assert all(after[k].abs().sum() > 0 for k in start if k.endswith("lora_B"))  # every B moved off 0
    assert metrics["grad/norm_adamw"] > 0 and metrics["grad/norm_muon"] == 0


def test_zrl_export_merges_a_lora_checkpoint_into_its_base(stepped, tiny_checkpoint, tmp_path):
    """`zrl export` of a LoRA run's checkpoint (adapters only): the run's recipe says how the trainer adapted
    the model, the base comes from the model path, the export is the merged model, as the trainer exports it."""
    run = tmp_path / "run"
    shutil.copytree(stepped["root"] / "ckpt", run / "checkpoints" / "step_1")
    model = {"path": str(tiny_checkpoint), "dtype": "float32", "lora": LORA.model_dump()}
    (run / "recipe.resolved.yaml").write_text(yaml.safe_dump({"model": model}))
    out = export_checkpoint(run / "checkpoints" / "step_1", tmp_path / "hf")
    exported = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == stepped["after_export"].keys()
    assert all(torch.equal(exported[k], v) for k, v in stepped["after_export"].items())


def test_onpolicy_copy_leaves_out_the_frozen_base_and_scores_exactly(tiny_checkpoint, single_rank):
    """Under LoRA the host copy of the synced version (zrl/trainer/onpolicy.py) holds the adapters and the
    buffers, not the frozen base (the same in every version), and tokens of that version scored under it
    still agree with their behaviour log-probs to the fp32 bound of the full fine-tuning test."""
    from test_onpolicy_scoring import SAME_WEIGHTS_KL, sampled_by

    ref = load_hf_checkpoint(tiny_checkpoint)
    worker = TrainerWorker(single_rank, tiny_checkpoint, settings(token_budget=256, kernels="reference"))
    worker.weights_synced()  # the engines hold version 0
    metrics = [worker.train_step(worker.share_of(sampled_by(ref, step, 0, seed=step + 1))) for step in range(2)]
    params = dict(worker.model.named_parameters())
    buffers = [v for k, v in worker.model.state_dict().items() if k not in params]
    adapters = sum(p.numel() for n, p in params.items() if is_adapter(n))
    assert sum(t.numel() for t in worker.synced._held) == adapters + sum(b.numel() for b in buffers)
    assert metrics[1]["mismatch/onpolicy_num_tokens"] > 0  # version-0 tokens scored at version 1
    assert metrics[1]["mismatch/onpolicy_kl_k3"] < SAME_WEIGHTS_KL


def test_a_lora_stage_after_a_full_one_trains_on_its_export_and_zrl_export_finds_that_base(
        tiny_checkpoint, single_rank, tmp_path):
    """recipes/tiny-lora-cpu.yaml in miniature: a full step, the stage's export, the worker `rebased` on it with
    adapters (as the controller does at the switch), a LoRA step. The step count continues; `zrl export` of the
    LoRA stage's checkpoint (adapters only) merges them into the first stage's export, not into model.path."""
    import json

    from zrl.config import load_recipe

    run = tmp_path / "run"
    recipe = load_recipe("recipes/tiny-lora-cpu.yaml", [f"model.path={tiny_checkpoint}", "model.lora.rank=4",
                                                        "model.lora.alpha=8", "stages.sft_warm_start.steps=1",
                                                        "stages.copy_rl.steps=1"])
    run.mkdir()
    (run / "recipe.resolved.yaml").write_text(json.dumps(recipe.model_dump(mode="json")))
    assert recipe.trainer_base(1) == "sft_warm_start"
    ref = load_hf_checkpoint(tiny_checkpoint)
    worker = TrainerWorker(single_rank, tiny_checkpoint, settings(lora=None))
    worker.train_step(worker.share_of(make_batch(ref)))
    worker.export_hf(run / "stages" / "sft_warm_start" / "hf", dtype=torch.float32)
    worker = worker.rebased(run / "stages" / "sft_warm_start" / "hf", settings())
    assert worker.version == 1 and any(is_adapter(n) for n, _ in worker.model.named_parameters())
    worker.train_step(worker.share_of(make_batch(ref, trainer_step=1)))
    worker.save_checkpoint(run / "checkpoints" / "step_000002", data_state={"stage": "copy_rl"})
    worker.export_hf(run / "stages" / "copy_rl" / "hf", dtype=torch.float32)
    worker.export_adapter(run / "stages" / "copy_rl" / "adapter")
    named = json.loads((run / "stages" / "copy_rl" / "adapter" / "adapter_config.json").read_text())
    assert named["base_model_name_or_path"] == str((run / "stages" / "sft_warm_start" / "hf").resolve())
    out = export_checkpoint(run / "checkpoints" / "step_000002", tmp_path / "hf")
    exported = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    stage = {k: v for f in sorted((run / "stages" / "copy_rl" / "hf").glob("*.safetensors"))
             for k, v in load_file(f).items()}
    assert exported.keys() == stage.keys() and all(torch.equal(exported[k], v) for k, v in stage.items())
