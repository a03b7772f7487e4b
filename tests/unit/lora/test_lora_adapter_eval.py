"""`zrl eval` / `zrl ttc` with `--adapter DIR`: the adapter merged into its base (the checkpoint its
adapter_config.json names, or CHECKPOINT) is what gets evaluated, in a temporary directory removed afterwards;
bad input is one line naming the option. The evaluation itself is replaced by a probe (no engine starts)."""

import json

import pytest
import torch

import zrl.evaluate
from lora_testlib import adapted, tiny_config, tiny_model
from zrl.cli import main
from zrl.models import get_family
from zrl.modeling.lora import merged_state_dict, save_peft_adapter

MODEL_TYPE = "qwen3_moe"


def save_base(path, model_type=MODEL_TYPE):
    get_family(model_type).save_hf_checkpoint(tiny_model(model_type).state_dict(), path,
                                              config=tiny_config(model_type), dtype=torch.float32)
    return path


@pytest.fixture
def evaluated(monkeypatch):
    """Replaces the evaluation: records the checkpoint directory it is given and the weights it holds there."""
    seen = {}

    def probe(checkpoints, *args, **kwargs):
        [checkpoint] = checkpoints
        seen["dir"] = checkpoint
        seen["state"] = get_family(MODEL_TYPE).load_state_dict(checkpoint, dtype=torch.float32)
        raise ValueError("probe: evaluated")  # cmd_eval's one-line exit, before any engine

    monkeypatch.setattr(zrl.evaluate, "evaluate_checkpoints", probe)
    return seen


@pytest.mark.parametrize("targets", [{}, {"experts": None, "dense_mlp": False, "router": False}],
                         ids=["every_target", "attention_only"])
def test_eval_takes_the_adapter_merged_into_the_base_it_names(targets, tmp_path, evaluated, capsys):
    base = save_base(tmp_path / "base")
    model = adapted(MODEL_TYPE, b_std=0.02, targets=targets)
    save_peft_adapter(model, tmp_path / "adapter", base_model=str(base))
    assert main(["eval", "--adapter", str(tmp_path / "adapter"), "--env", "strings"]) == 2
    assert capsys.readouterr().err == "zrl: error: probe: evaluated\n"
    expected = merged_state_dict(model)
    assert sorted(evaluated["state"]) == sorted(expected)
    for name, tensor in expected.items():  # the same fp32 merge: bitwise
        assert torch.equal(evaluated["state"][name], tensor), name
    assert not evaluated["dir"].exists()  # the merged checkpoint was temporary
    if targets:  # what the adapter does not touch is the base's
        assert torch.equal(evaluated["state"]["layers.0.mlp.experts.gate_up_proj"],
                           tiny_model(MODEL_TYPE).state_dict()["layers.0.mlp.experts.gate_up_proj"])


def test_an_explicit_base_wins_over_the_one_the_adapter_names(tmp_path, evaluated):
    base = save_base(tmp_path / "base")
    model = adapted(MODEL_TYPE, b_std=0.02)
    save_peft_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "gone"))
    assert main(["eval", str(base), "--adapter", str(tmp_path / "adapter"), "--env", "strings"]) == 2
    assert torch.equal(evaluated["state"]["embed_tokens.weight"], merged_state_dict(model)["embed_tokens.weight"])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["eval", "ttc"])
def test_bad_adapter_input_is_one_line_naming_the_option(command, tmp_path, capsys):
    base = save_base(tmp_path / "base")
    assert main([command, "--env", "strings"]) == 2
    assert one_error_line(capsys) == ("zrl: error: checkpoint: required (or --adapter DIR, whose "
                                      "adapter_config.json names its base)\n")
    (tmp_path / "empty").mkdir()
    assert main([command, "--adapter", str(tmp_path / "empty"), "--env", "strings"]) == 2
    assert one_error_line(capsys) == (f"zrl: error: --adapter: {tmp_path / 'empty'}: no adapter_config.json (not a "
                                      "PEFT adapter directory)\n")
    save_peft_adapter(adapted(MODEL_TYPE), tmp_path / "nameless")  # base_model None
    assert main([command, "--adapter", str(tmp_path / "nameless"), "--env", "strings"]) == 2
    assert "names no base_model_name_or_path; give the base as CHECKPOINT" in one_error_line(capsys)
    save_peft_adapter(adapted("zaya"), tmp_path / "other_family", base_model=str(base))
    assert main([command, "--adapter", str(tmp_path / "other_family"), "--env", "strings"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("zrl: error: --adapter: ") and line.endswith(f"(is {base} its base?)\n")
    config = json.loads((tmp_path / "nameless" / "adapter_config.json").read_text())
    (tmp_path / "nameless" / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    assert main([command, str(base), "--adapter", str(tmp_path / "nameless"), "--env", "strings"]) == 2
    assert "use_rslora is true; zrl merges plain LoRA" in one_error_line(capsys)
