"""The bootstrap picks its stack from the machine: the GPU stack where `nvidia-smi -L` lists a GPU (a
stand-in `nvidia-smi` on the PATH here), the CPU stack otherwise; --gpu / --cpu override; --dry-run
prints the set-up commands and changes nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = ROOT / "zrl" / "bootstrap.py"
STAMP = ROOT / ".venv" / ".zrl-install-stamp"


def fake_nvidia_smi(bin_dir: Path, listing: str, status: int = 0) -> None:
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f"echo '{line}'\n" for line in listing.splitlines())  # shell built-ins: PATH is bin_dir alone
    smi.write_text(f"#!/bin/sh\n{lines}exit {status}\n")
    smi.chmod(0o755)


def dry_run(bin_dir: Path, *options: str) -> list[str]:
    """The pip and python commands `bootstrap.py setup --dry-run` prints, with only `bin_dir` on the PATH."""
    before = STAMP.stat().st_mtime_ns if STAMP.exists() else None
    done = subprocess.run([sys.executable, str(BOOTSTRAP), "setup", "--dry-run", *options], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PATH": str(bin_dir)})
    assert done.returncode == 0, done.stderr
    assert (STAMP.stat().st_mtime_ns if STAMP.exists() else None) == before  # nothing installed, no stamp
    return done.stdout.splitlines()


def installs(commands: list[str]) -> str:
    (line,) = [c for c in commands if " install -e " in c]
    return line.rsplit("[", 1)[1].rstrip("]")


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    return path


def test_a_machine_that_lists_a_gpu_gets_the_gpu_stack(bin_dir):
    fake_nvidia_smi(bin_dir, "GPU 0: NVIDIA H200 (UUID: GPU-0f2c)\nGPU 1: NVIDIA H200 (UUID: GPU-9a1e)")
    commands = dry_run(bin_dir)
    assert installs(commands) == "gpu,dev"
    assert not any(" uninstall " in c for c in commands)  # the CPU stack's torchvision removal is CPU-only
    assert any("torch.version.cuda" in c for c in commands)  # the import check reports CUDA
    assert installs(dry_run(bin_dir, "--cpu")) == "cpu,dev"


def test_no_gpu_keeps_the_cpu_stack(bin_dir):
    commands = dry_run(bin_dir)  # no nvidia-smi at all
    assert installs(commands) == "cpu,dev"
    assert any(c.endswith("uninstall -y torchvision torchaudio torchcodec") for c in commands)
    assert installs(dry_run(bin_dir, "--gpu")) == "gpu,dev"


def test_a_driver_that_fails_or_lists_nothing_is_no_gpu(bin_dir):
    fake_nvidia_smi(bin_dir, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9)
    assert installs(dry_run(bin_dir)) == "cpu,dev"
    fake_nvidia_smi(bin_dir, "No devices were found", 6)
    assert installs(dry_run(bin_dir)) == "cpu,dev"


def test_gpu_and_cpu_together_are_refused(bin_dir):
    done = subprocess.run([sys.executable, str(BOOTSTRAP), "setup", "--dry-run", "--gpu", "--cpu"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": str(bin_dir)})
    assert done.returncode != 0 and done.stderr.strip() == "bootstrap: --gpu and --cpu exclude each other"


def test_runs_on_an_interpreter_that_has_not_imported_types_yet(bin_dir):
    """`python3 zrl/bootstrap.py` puts zrl/ first on sys.path; zrl/types.py must not shadow the standard
    library's `types` there. `-S` (no site module) starts the interpreter as Debian's python3 does,
    without `types` loaded: the bootstrap then failed with a circular import of zrl/types.py."""
    done = subprocess.run([sys.executable, "-S", str(BOOTSTRAP), "setup", "--dry-run", "--cpu"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PATH": str(bin_dir)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert installs(done.stdout.splitlines()) == "cpu,dev"
