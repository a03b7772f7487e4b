"""zrl/hub.py: model paths that name Hugging Face Hub repos, resolved offline from a fake local cache;
the one-line error for a repo that is not there; build_tiny_if_missing building only at scratch asset
paths (the trap: a recipe pointed at a real checkpoint not downloaded yet must not get a random tiny
model); `zrl validate` and `zrl eval` on repo ids.

No test touches the network. The fake cache has the layout huggingface_hub writes
(`models--org--name/refs/<ref>` holding a commit, `snapshots/<commit>/<files>`), HF_HUB_CACHE points at
it and HF_HUB_OFFLINE is on. huggingface_hub reads both once, at import (huggingface_hub.constants), so
the fixture sets the module's values as well as the environment.
"""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from zrl.cli import main
from zrl.config import parse_recipe
from zrl.config.schema import RewardModelSpec
from zrl.hub import ModelPathError, is_hub_id, locate, resolve, scratch_refusal

MAIN = "a" * 40  # the commit `main` points at
TAGGED = "b" * 40  # the commit of tag v1


def one_line(exc_info, *needles: str) -> str:
    message = str(exc_info.value)
    assert "\n" not in message and all(n in message for n in needles), message
    return message


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline Hugging Face cache holding org/name at `main` (MAIN) and tag v1 (TAGGED); the test runs
    in an empty working directory, so no relative path exists by accident."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    repo = cache / "models--org--name"
    for ref, commit in (("main", MAIN), ("v1", TAGGED)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text('{"model_type": "zaya"}')
        (snapshot / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache


def snapshot(cache: Path, commit: str) -> Path:
    return cache / "models--org--name" / "snapshots" / commit


def test_what_names_a_repo(hub_cache):
    assert is_hub_id("org/name") and is_hub_id("Zyphra/ZAYA1-8B")
    for local in ("model", "./org/name", "/abs/org", "~/org", "a/b/c", "org/na--me", "org/"):
        assert not is_hub_id(local), local
    Path("org/name").mkdir(parents=True)  # an existing directory of that name wins
    assert not is_hub_id("org/name")


def test_a_cached_repo_resolves_offline_to_its_snapshot(hub_cache):
    assert resolve("org/name", None, "model.path") == snapshot(hub_cache, MAIN)
    assert resolve("org/name", "v1", "model.path") == snapshot(hub_cache, TAGGED)  # a tag
    assert resolve("org/name", TAGGED, "model.path") == snapshot(hub_cache, TAGGED)  # a commit
    where = locate("org/name", "v1", "model.path")
    assert (where.repo_id, where.commit, where.missing) == ("org/name", TAGGED, None)
    assert where.describe() == (f"Hugging Face repo org/name (revision v1): cached snapshot "
                                f"{snapshot(hub_cache, TAGGED)} (commit {TAGGED})")


def test_a_repo_missing_offline_is_one_line_with_the_download_command(hub_cache):
    with pytest.raises(ModelPathError) as exc_info:
        resolve("Zyphra/ZAYA1-8B", "v2", "model.path")
    assert one_line(exc_info) == (
        f"model.path: Zyphra/ZAYA1-8B is neither a local directory nor in the Hugging Face cache ({hub_cache}), and "
        "HF_HUB_OFFLINE is set; download it with: hf download Zyphra/ZAYA1-8B --revision v2")
    with pytest.raises(ModelPathError) as exc_info:  # a cached repo, a revision that is not
        resolve("org/name", "v9", "reward_model.path")
    one_line(exc_info, "reward_model.path: org/name", "hf download org/name --revision v9")


def test_online_an_uncached_repo_is_downloaded_and_a_failed_download_is_one_line(hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    real = huggingface_hub.snapshot_download
    calls = []

    def fake(repo_id, revision=None, local_files_only=False):
        calls.append((repo_id, revision, local_files_only))
        if local_files_only:
            return real(repo_id, revision=revision, local_files_only=True)
        if repo_id == "org/unreachable":
            raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub,\nand more")
        return str(snapshot(hub_cache, MAIN))  # as if it had just been written

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert locate("org/new", None, "model.path").local is None  # validate: downloaded on first use, not missing
    assert resolve("org/new", "v3", "model.path") == snapshot(hub_cache, MAIN)
    assert calls[-2:] == [("org/new", "v3", True), ("org/new", "v3", False)]
    calls.clear()
    assert resolve("org/name", None, "model.path") == snapshot(hub_cache, MAIN)
    assert calls == [("org/name", None, True)]  # cached: the Hub is not asked
    with pytest.raises(ModelPathError) as exc_info:
        resolve("org/unreachable", None, "model.path")
    one_line(exc_info, "model.path: downloading org/unreachable from the Hugging Face Hub failed",
             "download it with: hf download org/unreachable")


def test_a_revision_with_a_local_directory_is_refused(hub_cache):
    with pytest.raises(ModelPathError) as exc_info:
        locate("./checkpoints/zaya", "main", "model.path")
    one_line(exc_info, "model.path: ./checkpoints/zaya is a local directory", "Hugging Face repo ids only")


def test_scratch_asset_paths(tmp_path):
    what = "model checkpoint directory"
    assert scratch_refusal(tmp_path / "runs" / "tiny-zaya", what) is None  # new
    (tmp_path / "tiny-empty").mkdir()
    assert scratch_refusal(tmp_path / "tiny-empty", what) is None  # empty
    assert "whose name starts with 'tiny-'" in scratch_refusal(tmp_path / "zaya1-8b", what)
    assert "whose name starts with 'tiny-'" in scratch_refusal(tmp_path / "tinyllama", what)
    (tmp_path / "tiny-used").mkdir()
    (tmp_path / "tiny-used" / "notes.txt").write_text("mine")
    assert "is not empty" in scratch_refusal(tmp_path / "tiny-used", what)
    (tmp_path / "tiny-file").write_text("x")
    assert "exists and is not a directory" in scratch_refusal(tmp_path / "tiny-file", what)


# --- the tiny-model trap ------------------------------------------------------------------------------------

def tiny_recipe(model_path: str, **model):
    return parse_recipe({"name": "t", "model": {"path": model_path, "build_tiny_if_missing": True, **model},
                         "output_dir": "out", "stages": [{"name": "s", "kind": "sft", "steps": 1,
                                                          "environments": [{"name": "strings"}]}]})


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """Where prepare_model / prepare_reward_model build a tiny model (recorded, with a stand-in checkpoint)."""
    import zrl.reward_model
    from zrl.models import get_family, registered_types

    built = []

    def builder(model_type: str | None):
        def build(path, seed=0):
            built.append(Path(path))
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "config.json").write_text(json.dumps({"model_type": model_type} if model_type else {}))
            (Path(path) / "model.safetensors").write_bytes(b"")
            (Path(path) / "tokenizer.json").write_text("{}")
            return Path(path)
        return build

    for model_type in registered_types():
        monkeypatch.setattr(type(get_family(model_type)), "build_tiny", staticmethod(builder(model_type)))
    monkeypatch.setattr(zrl.reward_model, "build_tiny_reward_model", builder(None))
    return built


def test_build_tiny_if_missing_builds_nothing_at_a_real_checkpoint_path(hub_cache, builds, tmp_path):
    from zrl.run import prepare_model

    kept = tmp_path / "kept"  # an existing directory with someone's files in it
    kept.mkdir()
    (kept / "weights.bin").write_bytes(b"keep me")
    cases = {
        "Zyphra/ZAYA1-8B": "hf download Zyphra/ZAYA1-8B",  # a repo id, not downloaded yet
        str(tmp_path / "checkpoints" / "zaya1-8b-sft"): "whose name starts with 'tiny-'",  # a path not there yet
        str(kept): "whose name starts with 'tiny-'",
    }
    for path, needle in cases.items():
        with pytest.raises(ModelPathError) as exc_info:
            prepare_model(tiny_recipe(path))
        one_line(exc_info, f"model.path: {path}", needle)
    assert builds == []
    assert not (tmp_path / "checkpoints").exists() and not Path("Zyphra").exists()
    assert [p.name for p in kept.iterdir()] == ["weights.bin"]


def test_build_tiny_if_missing_builds_nothing_in_a_non_empty_scratch_directory(builds, tmp_path):
    from zrl.run import prepare_model

    (tmp_path / "tiny-zaya").mkdir()
    (tmp_path / "tiny-zaya" / "tokenizer.json").write_text("{}")  # e.g. an interrupted build
    with pytest.raises(ModelPathError) as exc_info:
        prepare_model(tiny_recipe(str(tmp_path / "tiny-zaya")))
    one_line(exc_info, "is not empty", "remove it to rebuild")
    assert builds == []


def test_build_tiny_if_missing_builds_at_a_scratch_path(builds, tmp_path):
    from zrl.reward_model import prepare_reward_model
    from zrl.run import prepare_model

    assert prepare_model(tiny_recipe(str(tmp_path / "runs" / "tiny-zaya"))) == tmp_path / "runs" / "tiny-zaya"
    rm = RewardModelSpec(path=str(tmp_path / "tiny-rm"), build_tiny_if_missing=True)
    assert prepare_reward_model(rm) == tmp_path / "tiny-rm"
    assert builds == [tmp_path / "runs" / "tiny-zaya", tmp_path / "tiny-rm"]
    assert prepare_model(tiny_recipe(str(tmp_path / "runs" / "tiny-zaya"))) == tmp_path / "runs" / "tiny-zaya"
    assert len(builds) == 2  # a checkpoint now: not built again


def test_build_tiny_if_missing_builds_the_recipes_tiny_arch(builds, tmp_path):
    from zrl.run import prepare_model

    for arch in ("zaya", "qwen3_moe"):
        path = prepare_model(tiny_recipe(str(tmp_path / f"tiny-{arch}"), tiny_arch=arch))
        assert json.loads((path / "config.json").read_text()) == {"model_type": arch}
    assert builds == [tmp_path / "tiny-zaya", tmp_path / "tiny-qwen3_moe"]


def test_the_reward_model_follows_the_same_rules(hub_cache, builds, tmp_path):
    from zrl.reward_model import local_spec, prepare_reward_model

    with pytest.raises(ModelPathError) as exc_info:
        prepare_reward_model(RewardModelSpec(path="org/rm", build_tiny_if_missing=True))
    one_line(exc_info, "reward_model.path: org/rm", "hf download org/rm")
    with pytest.raises(ModelPathError) as exc_info:
        prepare_reward_model(RewardModelSpec(path=str(tmp_path / "reward-model"), build_tiny_if_missing=True))
    one_line(exc_info, "reward_model.path:", "whose name starts with 'tiny-'")
    assert builds == []
    (snapshot(hub_cache, MAIN) / "tokenizer.json").write_text("{}")  # now a complete RM checkpoint
    resolved = local_spec(RewardModelSpec(path="org/name", revision="main", batch_size=3))
    assert (resolved.path, resolved.revision, resolved.batch_size) == (str(snapshot(hub_cache, MAIN)), None, 3)


# --- zrl validate / zrl eval ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from zrl.assets import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("hub") / "tiny-zaya")


def write_recipe(tmp_path: Path, model: dict) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({
        "name": "r", "model": model, "output_dir": str(tmp_path / "out"),
        "stages": [{"name": "s", "kind": "sft", "steps": 1, "max_sequence_tokens": 96,
                    "environments": [{"name": "strings", "options": {"tasks": "copy"}}]}]}))
    return str(path)


def test_validate_names_the_cached_snapshot(hub_cache, tiny_model, tmp_path, capsys):
    shutil.rmtree(snapshot(hub_cache, TAGGED))
    shutil.copytree(tiny_model, snapshot(hub_cache, TAGGED))
    assert main(["validate", write_recipe(tmp_path, {"path": "org/name", "revision": "v1"})]) == 0
    out = capsys.readouterr().out
    assert (f"model.path: Hugging Face repo org/name (revision v1): cached snapshot {snapshot(hub_cache, TAGGED)} "
            f"(commit {TAGGED})\n") in out
    assert out.endswith("absent on this machine: nothing\n")


def test_validate_reports_a_repo_missing_offline_and_never_the_tiny_model_for_it(hub_cache, tmp_path, capsys):
    assert main(["validate", write_recipe(tmp_path, {"path": "Zyphra/ZAYA1-8B", "build_tiny_if_missing": True})]) == 0
    out = capsys.readouterr().out
    assert "absent on this machine (1 item; a run needs them, --strict fails on them):\n  model.path: Zyphra/ZAYA1-8B is neither a " \
           "local directory nor in the Hugging Face cache" in out
    assert "download it with: hf download Zyphra/ZAYA1-8B\n" in out
    assert "tiny" not in out
    assert main(["run", write_recipe(tmp_path, {"path": "Zyphra/ZAYA1-8B", "build_tiny_if_missing": True})]) == 2
    assert "model.path: Zyphra/ZAYA1-8B is neither a local directory" in capsys.readouterr().err


def test_validate_refuses_to_build_over_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "tiny-zaya").mkdir()
    (tmp_path / "tiny-zaya" / "weights.bin").write_bytes(b"x")
    model = {"path": str(tmp_path / "tiny-zaya"), "build_tiny_if_missing": True}
    assert main(["validate", write_recipe(tmp_path, model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"model.path: {tmp_path / 'tiny-zaya'} is not a model checkpoint directory" in err \
        and "is not empty" in err
    model["path"] = str(tmp_path / "zaya1-8b")  # not here: missing, not built
    assert main(["validate", write_recipe(tmp_path, model)]) == 0
    assert f"\n  model.path: {tmp_path / 'zaya1-8b'} is not a model" in capsys.readouterr().out


def test_eval_of_a_repo_missing_offline_is_one_line(hub_cache, capsys):
    assert main(["eval", "Zyphra/ZAYA1-8B", "--revision", "v2", "--env", "strings"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zrl: error: checkpoint: Zyphra/ZAYA1-8B is neither") \
        and err.endswith("download it with: hf download Zyphra/ZAYA1-8B --revision v2\n")
    (snapshot(hub_cache, MAIN) / "config.json").unlink()
    assert main(["ttc", "org/name", "--env", "strings"]) == 2
    assert capsys.readouterr().err == (f"zrl: error: org/name (snapshot {snapshot(hub_cache, MAIN)}): not a "
                                       "checkpoint directory (no config.json)\n")
