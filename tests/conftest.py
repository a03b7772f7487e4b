"""Session-wide test set-up: project-owned compile caches, offline services, Triton's interpreter without
CUDA, GPU-test skipping, the parallel workers' scheduling and Ray turns, and the summary of where the suite's
time went (docs/testing.md).

Caches (TorchInductor, vLLM, Triton) live in `<repo>/.cache` so a warm run reuses compiled ops;
`zrl/bootstrap.py` sets the same variables, this file covers a plain `pytest` call too.
"""

import fcntl
import json
import math
import os
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
for _var, _sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("VLLM_CACHE_ROOT", "vllm"),
                   ("TRITON_CACHE_DIR", "triton")):
    os.environ.setdefault(_var, str(CACHE / _sub))
    Path(os.environ[_var]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# Without CUDA, tests of the Triton backend run its kernels through Triton's interpreter. Triton reads
# TRITON_INTERPRET when a kernel is created, and any test may create one first, so it is set here, before
# collection, for every invocation (`pytest tests/unit` too), as zrl/moepp/kernels/conftest.py does for
# the kernel folders. torch is imported after the cache variables above are set.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- Parallel workers (pytest-xdist; `python3 zrl/bootstrap.py test` runs two) ----------------------------
# Scheduling unit (pytest_xdist_make_scheduler): a file (its module fixtures run once), or the whole serving
# folder (its session engines are built once, by the worker that runs it). Each worker runs its files in
# collection order, so a worker's unit tests still come before any in-process vLLM engine of the serving tests.
SHARED_SESSION_DIRS = ("tests/integration/serving/",)
# Tests that start Ray (in the test process or through `zrl run`) live here; the README's commands end with
# `ray stop`, which stops every Ray instance of the user, so they run while no other test holds Ray.
RAY_DIRS = ("tests/integration/", "tests/faults/", "tests/e2e/")
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
DURATIONS_FILE = ROOT / "tests" / "ray_file_durations.json"  # scope -> seconds, from `--store-durations`
RAY_WAIT = "ray_turn_wait_s"  # user property of a set-up report: seconds its module waited for its Ray turn

if XDIST_WORKER:
    # One intra-op thread per worker: two workers with two OpenMP threads each on two cores spend their time
    # in OpenMP barriers (tests/integration/serving/conftest.py measured 10-20x slower steps).
    torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Files as the units handed to the workers, the serving folder as one (xdist's loadgroup does not group
    on this pytest)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return FileScheduling(config, log)


def scope_of(nodeid: str) -> str:
    """The scheduling unit of a test: its file, or the shared-session folder it is in."""
    path = nodeid.split("::", 1)[0]
    return next((d for d in SHARED_SESSION_DIRS if path.startswith(d)), path)


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each Ray-starting file's measured seconds to {DURATIONS_FILE.relative_to(ROOT)} "
                          "(the order the parallel workers take them in)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    # The longest test that holds Ray alone starts first, while the other worker runs unit tests; then the
    # files that start Ray, longest first by their recorded seconds (a file not recorded yet counts as
    # longest), so the last files either worker takes are short and both finish together.
    recorded = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.is_file() else {}

    def order(item):
        scope = scope_of(item.nodeid)
        starts_ray = scope.startswith(RAY_DIRS)
        return "ray_exclusive" not in item.keywords, starts_ray, -recorded.get(scope, math.inf) if starts_ray else 0
    items.sort(key=order)  # stable: the unit tests keep their order


_unreported_wait_s: dict[Path, float] = {}  # module -> its Ray-turn wait, until its first set-up report carries it


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "setup" and item.path in _unreported_wait_s:  # sent to the xdist controller with the report
        report.user_properties.append((RAY_WAIT, _unreported_wait_s.pop(item.path)))
    return report


def _lock_path() -> Path:
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"zrl-tests-ray-{uid}.lock"


@pytest.fixture(scope="module", autouse=True)
def _ray_turn(request):
    """A module that starts Ray shares the machine's Ray with the other worker's; a `ray_exclusive` one holds
    it alone (flock: shared vs exclusive, for the module's whole life, its fixtures' Ray instances included)."""
    path = Path(str(request.path)).resolve().relative_to(ROOT).as_posix()
    if not XDIST_WORKER or not path.startswith(RAY_DIRS):
        yield
        return
    exclusive = request.node.get_closest_marker("ray_exclusive") is not None
    with _lock_path().open("a") as handle:
        asked = time.monotonic()
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        _unreported_wait_s[request.path] = time.monotonic() - asked  # in the set-up of the module's first test
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- The suite's wall time and its slowest tests, printed at the end of every run ----------------------------
KINDS = ("tests/unit/", "zrl/", "tests/distributed/", "tests/integration/", "tests/faults/", "tests/e2e/")
_durations: dict[str, float] = {}
_spans: dict[str, list[tuple[float, float, str]]] = {}  # worker -> (start, stop, nodeid) of each report
_ray_wait_s: dict[str, float] = {}                       # worker -> seconds its modules waited for their Ray turn
_started = time.monotonic()


def pytest_runtest_logreport(report):
    """Setup, call and teardown of a test, summed: the time a test costs the suite (a module or session
    fixture's set-up counts in the test that first needed it). Under xdist the controller sees every report."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    node = getattr(report, "node", None)  # the worker that ran it (xdist)
    worker = node.gateway.id if node is not None else "main"
    _spans.setdefault(worker, []).append((report.start, report.stop, report.nodeid))
    if report.when == "setup":
        waited = dict(report.user_properties).get(RAY_WAIT, 0.0)
        _ray_wait_s[worker] = _ray_wait_s.get(worker, 0.0) + waited


def _worker_lines(wall_end: float) -> list[str]:
    """Per worker: minutes busy, waiting for a Ray turn (inside `busy`), idle between tests and at the end,
    and the longest idle gap with the test that followed it."""
    lines = []
    first = min(start for spans in _spans.values() for start, _, _ in spans)
    for worker, spans in sorted(_spans.items()):
        spans = sorted(spans)
        busy = sum(stop - start for start, stop, _ in spans)
        gaps = [(b[0] - a[1], b[2]) for a, b in zip(spans, spans[1:])]
        longest = max(gaps, default=(0.0, ""))
        tail = wall_end - spans[-1][1]
        lines.append(f"{worker}: busy {busy / 60:.1f} min (waiting for a Ray turn {_ray_wait_s.get(worker, 0) / 60:.1f}), "
                     f"idle between tests {sum(g for g, _ in gaps) / 60:.1f} min (longest {longest[0]:.0f} s, before "
                     f"{longest[1] or '-'}), started {(spans[0][0] - first):.0f} s in, done {tail / 60:.1f} min "
                     "before the end")
    return lines


def pytest_terminal_summary(terminalreporter):
    if XDIST_WORKER or not _durations:
        return
    write = terminalreporter.write_line
    wall = time.monotonic() - _started
    workers = getattr(terminalreporter.config.option, "numprocesses", None) or 0
    write("")
    write(f"suite wall time {wall / 60:.1f} min ({wall:.0f} s), {len(_durations)} tests, "
          f"{sum(_durations.values()) / 60:.1f} min of test time, {workers or 'no'} parallel workers")
    by_kind: dict[str, list] = {}
    for nodeid, seconds in _durations.items():
        kind = next((k for k in KINDS if nodeid.startswith(k)), "other").rstrip("/")
        entry = by_kind.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
    write("  ".join(f"{kind}: {n} tests {s / 60:.1f} min" for kind, (n, s) in by_kind.items()))
    for line in _worker_lines(time.time()):
        write(line)
    write("20 slowest tests (setup + call + teardown):")
    for nodeid, seconds in sorted(_durations.items(), key=lambda kv: -kv[1])[:20]:
        write(f"  {seconds:7.1f} s  {nodeid}")
    if terminalreporter.config.getoption("--store-durations"):
        scopes: dict[str, float] = {}
        for nodeid, seconds in _durations.items():
            if nodeid.startswith(RAY_DIRS):
                scopes[scope_of(nodeid)] = scopes.get(scope_of(nodeid), 0.0) + seconds
        DURATIONS_FILE.write_text(json.dumps({k: round(v) for k, v in sorted(scopes.items())}, indent=1) + "\n")
        write(f"durations of {len(scopes)} Ray-starting files written to {DURATIONS_FILE}")
