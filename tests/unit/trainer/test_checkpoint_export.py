"""`zrl export`: a trainer checkpoint, written in process by a 1-rank TrainerWorker after one step as the
trainer writes it (torch.distributed.checkpoint), becomes a Hugging Face directory equal to the stage
export of the same weights; the export itself runs with no process group. Bad inputs are one line."""

import json
import shutil
import socket

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from zrl.cli import main
from zrl.config import load_recipe
from zrl.config.schema import Algorithm, DPPOBinaryTV, MuonSpec, Optimizer
from zrl.models import family_of_checkpoint, get_family
from zrl.moepp import load_hf_checkpoint
from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker
from zrl.trainer.distributed import init_process_group
from zrl.trainer.synthetic import synthetic_train_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*returned a view tensor")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    """A run directory as `zrl run` leaves it: recipe.resolved.yaml naming the tiny model, a checkpoint of
    trainer step 1 and the stage export of the same weights; then the process group is gone. Returns
    (run directory, the trained weights by state-dict name)."""
    root = tmp_path_factory.mktemp("export") / "run"
    recipe = load_recipe("recipes/tiny-cpu.yaml", [f"model.path={tiny_checkpoint}", "model.dtype=float32"])
    root.mkdir()
    (root / "recipe.resolved.yaml").write_text(json.dumps(recipe.model_dump(mode="json")))  # JSON is YAML
    rendezvous = Rendezvous("127.0.0.1", free_port(), rank=0, world_size=1, backend="gloo", timeout_s=60)
    created = init_process_group(rendezvous)
    try:
        settings = TrainerSettings(param_dtype="float32", token_budget=40, max_response_tokens=40,
                                   optimizer=Optimizer(muon=MuonSpec(lr=1e-2)),
                                   algorithm=Algorithm(trust_region=DPPOBinaryTV(delta=2e-4)))
        worker = TrainerWorker(rendezvous, tiny_checkpoint, settings)
        ref = load_hf_checkpoint(tiny_checkpoint)
        cfg = ref.config
        batch = synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg), num_groups=2, group_size=4, trainer_step=0,
                                      seed=3, model=ref, logprob_noise=0.2)
        worker.train_step(worker.share_of(batch))
        worker.save_checkpoint(root / "checkpoints" / "step_000001", data_state={"stage": "s"})
        worker.export_hf(root / "stages" / "s" / "hf", dtype=torch.float32)
        trained = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                   for k, v in worker.model.state_dict().items()}
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    return root, trained


def tensors(directory) -> dict[str, torch.Tensor]:
    return {k: v for path in sorted(directory.glob("*.safetensors")) for k, v in load_file(path).items()}


def test_the_export_is_the_stage_export_of_the_trained_weights(run, tiny_checkpoint, tmp_path, capsys):
    root, trained = run
    assert not dist.is_initialized()  # no process group: `zrl export` is one plain process
    out = tmp_path / "hf"
    assert main(["export", str(root / "checkpoints" / "step_000001"), str(out)]) == 0
    assert capsys.readouterr().out == f"Hugging Face checkpoint written to {out}\n"
    exported, stage = tensors(out), tensors(root / "stages" / "s" / "hf")
    assert exported.keys() == stage.keys()
    assert all(torch.equal(exported[k], stage[k]) for k in exported)
    family = family_of_checkpoint(out)
    loaded = family.load_state_dict(out, dtype=torch.float32)
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    initial = family.load_state_dict(tiny_checkpoint, dtype=torch.float32)
    assert any(not torch.equal(initial[k], trained[k]) for k in trained)  # the step moved the weights
    assert json.loads((out / "config.json").read_text()) == json.loads((root / "stages/s/hf/config.json").read_text())


def test_zrl_evals_loaders_read_the_export(run, tmp_path):
    """What `zrl eval` reads before its engine starts: config.json (the checkpoint check, the family's
    parser, transformers' AutoConfig that vLLM uses) and the tokenizer with its chat template."""
    from transformers import AutoConfig, AutoTokenizer

    from zrl.cli import _checkpoint, build_parser

    root, _ = run
    out = tmp_path / "hf"
    assert main(["export", str(root / "checkpoints" / "step_000001"), str(out), "--dtype", "bfloat16"]) == 0
    assert _checkpoint(build_parser().parse_args(["eval", str(out), "--env", "strings"])) == out
    assert family_of_checkpoint(out).read_config(out).num_experts == AutoConfig.from_pretrained(out).num_experts
    assert {t.dtype for t in tensors(out).values() if t.is_floating_point()} >= {torch.bfloat16}
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False).endswith("<think>\n")


def test_bad_inputs_are_one_line(run, tmp_path, capsys):
    root, _ = run
    step = root / "checkpoints" / "step_000001"

    def error(*args) -> str:
        assert main(["export", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("zrl: error: "), err
        return err[len("zrl: error: "):].strip()

    assert error(tmp_path / "nope", tmp_path / "a") == f"{tmp_path / 'nope'}: no such directory"
    (tmp_path / "half").mkdir()
    assert error(tmp_path / "half", tmp_path / "a") == (f"{tmp_path / 'half'} is not a complete trainer checkpoint "
                                                        "(no trainer_state.json)")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert error(step, tmp_path / "full") == f"{tmp_path / 'full'}: exists and is not an empty directory"
    elsewhere = tmp_path / "elsewhere"  # a checkpoint outside its run: no recipe to name the model
    shutil.copytree(step, elsewhere)
    assert "give --model" in error(elsewhere, tmp_path / "a")
    from zrl.models import get_family

    qwen = get_family("qwen3_moe").build_tiny(tmp_path / "tiny-qwen")
    capsys.readouterr()  # the build's progress bar
    assert error(step, tmp_path / "a", "--model", qwen).startswith(f"{step}: does not hold the weights of {qwen}")
    assert not (tmp_path / "a").exists()
