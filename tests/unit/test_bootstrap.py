"""The bootstrap picks its stack from the machine: the GPU stack where `nvidia-smi -L` lists a GPU (a
stand-in `nvidia-smi` on the PATH here), the CPU stack otherwise; --gpu / --cpu override; --dry-run
prints the commands the set-up would run (none on an installed, up-to-date tree) and changes nothing.
Each test runs a copy of the bootstrap in a fresh tree (tmp_path/tree: pyproject.toml, zrl/), whose
`.venv` the test makes or leaves out."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2]
PUNKT_DOWNLOAD = "download --no-deps --only-binary=:all: -d "


def fake_nvidia_smi(bin_dir: Path, listing: str, status: int = 0, driver: str = "580.65.06") -> None:
    """`nvidia-smi -L` prints `listing` and exits with `status`; the driver query prints `driver` per GPU."""
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f"echo '{line}'\n" for line in listing.splitlines())  # shell built-ins: PATH is bin_dir alone
    gpus = sum(line.startswith("GPU ") for line in listing.splitlines())
    query = f"echo '{driver}'\n" * gpus
    smi.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then\n{lines}exit {status}\nfi\n{query}exit {status}\n')
    smi.chmod(0o755)


@pytest.fixture
def tree(tmp_path) -> Path:
    """A fresh checkout as far as the bootstrap sees: pyproject.toml, zrl/bootstrap.py and zrl/types.py (the
    module that would shadow the standard library's `types`), no .venv."""
    root = tmp_path / "tree"
    (root / "zrl").mkdir(parents=True)
    shutil.copy2(SOURCE / "pyproject.toml", root)
    for name in ("bootstrap.py", "types.py"):
        shutil.copy2(SOURCE / "zrl" / name, root / "zrl")
    return root


def installed(tree: Path, extras: str = "cpu,dev", nltk_data: bool = True) -> None:
    """Make `tree` look set up as `bootstrap.py setup` leaves it: .venv/bin/python, the stamp, NLTK's data."""
    spec = importlib.util.spec_from_file_location("tree_bootstrap", tree / "zrl" / "bootstrap.py")
    bootstrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bootstrap)
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "python").symlink_to(sys.executable)
    bootstrap.STAMP.write_text(bootstrap.install_fingerprint(extras) + "\n")
    for name in bootstrap.PUNKT_FILES if nltk_data else ():
        (tree / ".venv" / "nltk_data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / ".venv" / "nltk_data" / name).write_text("")


def bootstrap(tree: Path, bin_dir: Path, *options: str, interpreter: tuple[str, ...] = (sys.executable,)):
    """`bootstrap.py setup --dry-run OPTIONS` in `tree`, with only `bin_dir` on the PATH; it changes nothing."""
    before = sorted(tree.rglob("*"))
    done = subprocess.run([*interpreter, str(tree / "zrl" / "bootstrap.py"), "setup", "--dry-run", *options],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": str(bin_dir)})
    assert sorted(tree.rglob("*")) == before  # nothing installed, created or stamped
    return done


def dry_run(tree: Path, bin_dir: Path, *options: str) -> list[str]:
    """The commands `bootstrap.py setup --dry-run` prints."""
    done = bootstrap(tree, bin_dir, *options)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def installs(commands: list[str]) -> str:
    (line,) = [c for c in commands if " install -e " in c]
    (target,) = [word for word in line.split() if "[" in word]
    return target.rsplit("[", 1)[1].rstrip("]")


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    return path


def test_a_machine_that_lists_a_gpu_gets_the_gpu_stack(tree, bin_dir):
    fake_nvidia_smi(bin_dir, "GPU 0: NVIDIA H200 (UUID: GPU-0f2c)\nGPU 1: NVIDIA H200 (UUID: GPU-9a1e)")
    commands = dry_run(tree, bin_dir)
    assert installs(commands) == "gpu,dev"
    assert not any(" uninstall " in c for c in commands)  # the CPU stack's torchvision removal is CPU-only
    assert any("torch.version.cuda" in c for c in commands)  # the import check reports CUDA
    assert installs(dry_run(tree, bin_dir, "--cpu")) == "cpu,dev"


def test_no_gpu_keeps_the_cpu_stack(tree, bin_dir):
    commands = dry_run(tree, bin_dir)  # no nvidia-smi at all
    assert installs(commands) == "cpu,dev"
    assert any(c.endswith("uninstall -y torchvision torchaudio torchcodec") for c in commands)
    assert installs(dry_run(tree, bin_dir, "--gpu")) == "gpu,dev"


def test_a_driver_that_fails_or_lists_nothing_is_no_gpu(tree, bin_dir):
    fake_nvidia_smi(bin_dir, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9)
    assert installs(dry_run(tree, bin_dir)) == "cpu,dev"
    fake_nvidia_smi(bin_dir, "No devices were found", 6)
    assert installs(dry_run(tree, bin_dir)) == "cpu,dev"


def test_gpu_and_cpu_together_are_refused(tree, bin_dir):
    done = bootstrap(tree, bin_dir, "--gpu", "--cpu")
    assert done.returncode != 0 and done.stderr.strip() == "bootstrap: --gpu and --cpu exclude each other"


def test_runs_on_an_interpreter_that_has_not_imported_types_yet(tree, bin_dir):
    """`python3 zrl/bootstrap.py` puts zrl/ first on sys.path; zrl/types.py must not shadow the standard
    library's `types` there. `-S` (no site module) starts the interpreter as Debian's python3 does,
    without `types` loaded: the bootstrap then failed with a circular import of zrl/types.py."""
    done = bootstrap(tree, bin_dir, "--cpu", interpreter=(sys.executable, "-S"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert installs(done.stdout.splitlines()) == "cpu,dev"


def test_a_fresh_tree_lists_every_command_the_setup_runs(tree, bin_dir):
    commands = dry_run(tree, bin_dir, "--cpu")
    assert commands[0].endswith(f"-m venv {tree / '.venv'}")
    assert [c.split(" -m pip --disable-pip-version-check ")[1].split(" ")[:2] for c in commands[1:3]] == [
        ["install", "--upgrade"], ["install", "-e"]]
    assert commands[2].endswith(" --no-compile")  # bytecode is written on first import instead (cache_env)
    assert commands[3].split(" -m pip --disable-pip-version-check ")[1].split(" ")[:2] == ["uninstall", "-y"]
    assert "import torch, transformers, ray, vllm, zrl" in commands[4]
    assert PUNKT_DOWNLOAD in commands[5] and commands[5].endswith(" llama-index-core==0.14.25")  # NLTK's data
    assert len(commands) == 6


def test_an_installed_up_to_date_tree_would_do_nothing(tree, bin_dir):
    installed(tree)
    assert dry_run(tree, bin_dir) == ["installed and up to date (CPU stack); setup would do nothing"]


def test_an_installed_tree_lists_only_what_the_setup_would_still_do(tree, bin_dir):
    installed(tree, nltk_data=False)  # installed, NLTK's data missing: only its download
    (command,) = dry_run(tree, bin_dir)
    assert PUNKT_DOWNLOAD in command
    commands = dry_run(tree, bin_dir, "--gpu")  # another stack: a reinstall into the existing .venv
    assert not any(" -m venv " in c for c in commands) and installs(commands) == "gpu,dev"
    assert PUNKT_DOWNLOAD in commands[-1]


def test_the_gpu_stack_reports_the_driver_and_the_gpus(tree, bin_dir):
    done = bootstrap(tree, bin_dir, "--gpu")  # no nvidia-smi
    assert "warning: no nvidia-smi on the PATH: no NVIDIA driver found" in done.stderr
    fake_nvidia_smi(bin_dir, "GPU 0: NVIDIA H200 (UUID: GPU-0f2c)", driver="580.65.06")
    done = bootstrap(tree, bin_dir, "--gpu")
    report = f"nvidia-smi: {bin_dir / 'nvidia-smi'}, driver 580.65.06, 1 GPU(s) listed\n  GPU 0: NVIDIA H200"
    assert report in done.stderr
    assert "warning" not in done.stderr
    fake_nvidia_smi(bin_dir, "GPU 0: NVIDIA H100 (UUID: GPU-0f2c)", driver="550.54.15")
    assert "warning: driver 550.54.15: the GPU stack's CUDA 13 torch needs driver 580 or newer" in bootstrap(
        tree, bin_dir, "--gpu").stderr
    fake_nvidia_smi(bin_dir, "No devices were found", 6)
    assert "warning: nvidia-smi lists no GPU" in bootstrap(tree, bin_dir, "--gpu").stderr
    assert "nvidia-smi" not in bootstrap(tree, bin_dir, "--cpu").stderr  # the CPU stack asks nothing of it


def test_the_test_command_runs_two_workers_unless_the_caller_chooses(monkeypatch):
    path = Path(__file__).resolve().parents[2] / "zrl" / "bootstrap.py"
    spec = importlib.util.spec_from_file_location("bootstrap_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert module.xdist_args([]) == ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
    assert module.xdist_args(["tests/unit", "-x"])[:2] == ["-n", "2"]
    for chosen in (["-n", "0"], ["-n0"], ["--numprocesses=4"], ["-p", "no:xdist"], ["--dist", "load"]):
        assert module.xdist_args(chosen) == [], chosen
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert module.xdist_args([]) == []
