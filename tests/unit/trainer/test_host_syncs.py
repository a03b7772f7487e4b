"""Host synchronisations of one trainer microbatch (building it, forward with router replay, loss,
statistics, backward), counted on CPU.

On a GPU every op that needs a device value on the host (`.item()`, `bool(t)`, `.tolist()`, a copy
to the CPU, an output whose size depends on the data: `nonzero`, boolean-mask indexing, `bincount`,
`unique`, `repeat_interleave` without `output_size`) stops the host until the GPU has drained its
queue, and so does a blocking host-to-device copy (`torch.tensor(data, device=...)`, `.to(device)` of
a host tensor: PyTorch synchronises the stream after the copy). Meanwhile no kernels are queued. On
the CPU nothing waits, so `SyncCounter` counts the ops that WOULD wait on CUDA.

Every tensor is taken to live on the device except those known to be host data: made by
`torch.from_numpy`, `torch.tensor`/`as_tensor` without a device, `pin_memory`, and what ops make from
host data alone. Reading a host tensor costs nothing; copying one to the device counts unless it is
`non_blocking`. Aten ops are seen by a dispatch mode, which autograd carries into backward (and into
activation checkpointing's recomputation); the Python-level calls (`tolist`, `numpy`, `cpu`, `to`,
`torch.tensor`, ...) never reach the dispatcher on a CPU tensor and are wrapped for the duration.
"""

from __future__ import annotations

import collections
import traceback
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from zrl.config.schema import Algorithm, DPPOBinaryTV, MuonSpec, Optimizer
from zrl.moepp import load_hf_checkpoint
from zrl.modeling.kernels import AUTO_ON_CUDA
from zrl.modeling.logprobs import SamplingDistribution
from zrl.trainer import TrainerSettings, TrainerWorker
from zrl.models import get_family
from zrl.trainer.synthetic import synthetic_train_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*returned a view tensor")

ZRL_ROOT = Path(__file__).resolve().parents[3] / "zrl"
aten = torch.ops.aten
# ops whose output size depends on tensor values: CUDA reads a count on the host to allocate it
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default,
                   aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                   aten.unique_dim_consecutive.default, aten.argwhere.default}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _sync_kind(func, args, kwargs) -> str | None:
    """The name of the host synchronisation `func(*args, **kwargs)` makes on CUDA, None if it makes none."""
    if func is aten._local_scalar_dense.default:
        return "item"  # .item(), int(t), float(t), bool(t)
    if func in (aten.is_nonzero.default, aten.equal.default) or func in _DATA_DEPENDENT:
        return func.__name__.split(".")[0]
    if func in _INDEX_OPS and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
        return "boolean index"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    return None


def _to_device_of(args, kwargs):
    """The device a `Tensor.to(...)` call moves to, None when it only changes the dtype."""
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
    return device


class SyncCounter:
    """Counts the would-be synchronising ops run inside `with counter:`, by kind and by the line of
    zrl that issued them ("backward of <node>" for ops autograd runs)."""

    def __init__(self) -> None:
        self.by_site: collections.Counter[tuple[str, str]] = collections.Counter()
        self._host: dict[int, weakref.ref] = {}  # id -> tensor of the host data (see the module docstring)
        self._saved: list[tuple[object, str, object]] = []
        counter = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                from_host = bool(inputs) and all(counter.is_host(t) for t in inputs)
                kind = _sync_kind(func, args, kwargs)
                if kind is not None and not from_host:
                    counter._record(kind)
                out = func(*args, **kwargs)
                if from_host:
                    counter._mark(out)
                return out

        self._mode = Dispatch()

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor  # an id may be reused once its tensor is gone

    def _mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._host[id(t)] = weakref.ref(t)

    def _record(self, kind: str) -> None:
        node = torch._C._current_autograd_node()
        site = "?"
        for frame in reversed(traceback.extract_stack()):
            path = Path(frame.filename).resolve()
            if path.is_relative_to(ZRL_ROOT):
                site = f"{path.relative_to(ZRL_ROOT.parent)}:{frame.lineno} {frame.name}"
                break
        if node is not None:
            site = f"backward of {node.name()} ({site})"
        self.by_site[(kind, site)] += 1

    def _patch(self, owner, name: str, wrapper) -> None:
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper(getattr(owner, name)))

    def _wrappers(self):
        counter = self

        def device_read(name):  # device -> host copies
            def wrap(method):
                def call(tensor, *args, **kwargs):
                    if not counter.is_host(tensor):
                        counter._record(name)
                    return method(tensor, *args, **kwargs)
                return call
            return wrap

        def host_made(function):  # host data
            def call(*args, **kwargs):
                out = function(*args, **kwargs)
                counter._mark(out)
                return out
            return call

        def created(name):  # torch.tensor / as_tensor: a blocking copy when given a device
            def wrap(function):
                def call(*args, **kwargs):
                    out = function(*args, **kwargs)
                    if kwargs.get("device") is None:
                        counter._mark(out)
                    else:
                        counter._record(f"{name}(device=)")
                    return out
                return call
            return wrap

        def moved(method):  # Tensor.to
            def call(tensor, *args, **kwargs):
                device = _to_device_of(args, kwargs)
                blocking = not (kwargs.get("non_blocking") or any(a is True for a in args))
                out = method(tensor, *args, **kwargs)
                if counter.is_host(tensor):
                    if device is None:
                        counter._mark(out)  # a dtype change stays on the host
                        return out
                    if blocking:
                        counter._record("blocking copy to device")
                    if out is tensor:  # CPU to CPU returns the tensor itself: here it stands for a device copy
                        out = torch.Tensor.view_as(tensor, tensor)
                        counter._host.pop(id(out), None)
                return out
            return call

        def new_tensor(method):  # a blocking copy to the device of `tensor`
            def call(tensor, *args, **kwargs):
                if not counter.is_host(tensor):
                    counter._record("new_tensor")
                return method(tensor, *args, **kwargs)
            return call

        return [(torch.Tensor, "tolist", device_read("tolist")), (torch.Tensor, "numpy", device_read("numpy")),
                (torch.Tensor, "cpu", device_read("cpu")), (torch.Tensor, "to", moved),
                (torch.Tensor, "new_tensor", new_tensor), (torch.Tensor, "pin_memory", host_made),
                (torch, "from_numpy", host_made), (torch, "tensor", created("tensor")),
                (torch, "as_tensor", created("as_tensor"))]

    def __enter__(self) -> SyncCounter:
        for owner, name, wrapper in self._wrappers():
            self._patch(owner, name, wrapper)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)  # back to the method of torch.Tensor's C base class
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def table(self) -> str:
        return "\n".join(f"{n:4d}  {kind:24s} {site}" for (kind, site), n in sorted(self.by_site.items()))


def test_counter_sees_each_kind_of_sync():
    x = torch.arange(6, device="cpu")  # "device" data
    with SyncCounter() as c:
        host = torch.from_numpy(np.arange(6))  # host data: reading it is free, copying it is not
        x.sum().item()
        bool(x.any())
        x.tolist()
        x.cpu()
        x[x > 2]
        torch.bincount(x)
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=15)  # sized by the host: no sync
        torch.where(x > 2, x, 0)  # fixed shape: no sync
        torch.tensor([1, 2], device=x.device)
        x.new_tensor([1, 2])
        host.tolist()
        (host + 1).sum().item()  # host arithmetic: no sync
        host.long().to(x.device)
        torch.tensor([1, 2]).to(x.device, non_blocking=True)
    kinds = collections.Counter()
    for (kind, _), n in c.by_site.items():
        kinds[kind] += n
    assert kinds == {"item": 2, "tolist": 1, "cpu": 1, "boolean index": 1, "bincount": 1, "repeat_interleave": 1,
                     "tensor(device=)": 1, "new_tensor": 1, "blocking copy to device": 1}


def count_microbatches(worker: TrainerWorker, share, monkeypatch) -> list[SyncCounter]:
    """Run `train_step(share)`, counting each microbatch: building it, forward, loss, statistics, backward."""
    counters = []
    run = TrainerWorker._microbatch

    def counted(self, *args, **kwargs):
        with SyncCounter() as counter:
            result = run(self, *args, **kwargs)
        counters.append(counter)
        return result

    monkeypatch.setattr(TrainerWorker, "_microbatch", counted)
    worker.train_step(share)
    return counters


# Ops of the kernels' PyTorch references (zrl/modeling/kernels/*/reference.py, zrl/moepp/kernels/*/reference.py)
# are reported, not budgeted: they are what a CPU runs, while a GPU runs the fused kernels (see
# zrl/modeling/kernels/README.md).
KERNEL_REFERENCES = ("zrl/modeling/kernels/", "zrl/moepp/kernels/")
# Would-be host syncs per microbatch outside the kernels. Measured by this test before they were removed,
# for this 2-layer model with router replay: 24 = building the microbatch 9 (8 blocking copies of the
# per-token arrays, cu_seqlens made on the device) + build_layout 3 (cu_seqlens.tolist, the document
# lengths made on the device, repeat_interleave without output_size) + validate_replay 1
# (bool(bad.any())) + collect_routing 1 per layer (bincount) + StepStats.add_common 2 (int(mask.sum()),
# a host token-count vector copied over) + mismatch_sums 6 per 2 calls (boolean indexing of lp and lq,
# the token count made on the device) + the trust region's stats 1 (an inf made on the device).
# Now none: a step waits for the GPU once, at its end (PhaseClock.seconds, then the metrics).
BUDGET = 0


# The fused LM head (zrl/modeling/kernels/lm_logprobs/fused.py) is what the RL loss runs: its own sites
# must make none either, though they lie under the kernels' folder.
FUSED_HEAD = "zrl/modeling/kernels/lm_logprobs/fused.py"
# Likewise the references that "auto" runs on CUDA too (AUTO_ON_CUDA names "reference": the CCA's, which
# the model hands the layout's document count so that it reads none from the device).
CUDA_REFERENCES = tuple(f"/{op}/reference.py" for op, choice in AUTO_ON_CUDA.items() if choice == "reference")


@pytest.mark.parametrize("head", ["fused", "unfused"])
@pytest.mark.parametrize("checkpointing, sampling", [
    (True, SamplingDistribution()),
    (False, SamplingDistribution(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01)),  # the support-floor pass
], ids=["checkpointed", "filtered_sampling"])
def test_microbatch_host_syncs_within_budget(tiny_checkpoint, single_rank, monkeypatch, checkpointing, sampling,
                                             head):
    import zrl.trainer.loss as trainer_loss

    fused_calls = []
    if head == "unfused":
        monkeypatch.setattr(trainer_loss, "uses_fused_head", lambda *a: False)
    else:
        uses = trainer_loss.uses_fused_head
        monkeypatch.setattr(trainer_loss, "uses_fused_head", lambda *a: fused_calls.append(uses(*a)) or fused_calls[-1])
    ref = load_hf_checkpoint(tiny_checkpoint)
    cfg = ref.config
    batch = synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg), num_groups=2, group_size=3, trainer_step=0, seed=3,
                                  model=ref, logprob_noise=0.2)
    settings = TrainerSettings(param_dtype="float32", token_budget=64, max_response_tokens=40,
                               activation_checkpointing=checkpointing, kernels="reference", sampling=sampling,
                               optimizer=Optimizer(muon=MuonSpec(lr=1e-2)),
                               algorithm=Algorithm(trust_region=DPPOBinaryTV(delta=2e-4)))
    assert settings.replay
    worker = TrainerWorker(single_rank, tiny_checkpoint, settings)
    counters = count_microbatches(worker, worker.share_of(batch), monkeypatch)
    assert len(counters) >= 2
    for counter in counters:
        budgeted = sum(n for (_, site), n in counter.by_site.items()
                       if FUSED_HEAD in site or any(r in site for r in CUDA_REFERENCES)
                       or not any(k in site for k in KERNEL_REFERENCES))
        assert budgeted <= BUDGET, f"{budgeted} host syncs in one microbatch:\n{counter.table()}"
    assert head == "unfused" or (fused_calls and all(fused_calls)), "the RL loss ran the fused head"


def test_fused_head_split_products_make_no_host_sync():
    """The fused head with CUDA's products (bf16 parts; on CPU the same calls on fp32 values), a logit
    floor and ignored targets: no would-be host synchronisation, forward or backward."""
    from zrl.modeling.kernels.lm_logprobs.fused import FusedSplitProducts, fused_head_loss

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, 16, generator=gen).requires_grad_()
    weight = torch.randn(64, 16, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 64, (20,), generator=gen)
    targets[3] = -1
    floor = torch.randn(20, generator=gen)
    upstream = torch.randn(20, generator=gen)

    def token_grad(rows, logprob, entropy):
        return upstream[rows] * logprob, upstream[rows], upstream[rows]

    with SyncCounter() as counter:
        loss = fused_head_loss(hidden, weight, targets, token_grad, products=FusedSplitProducts, chunk_tokens=8,
                               with_entropy=True, floor=floor)[0]
        loss.backward()
    assert counter.total == 0, counter.table()


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_every_loss_aggregation_makes_no_host_sync(layout):
    """Each mode's loss and its per-token weights (what the fused head takes): seq_mean_token_mean counts
    the tokens of each rollout without `unique`/`bincount`, whose output sizes a GPU reads back."""
    from zrl.algorithms import AGGREGATION_NAMES, aggregate_loss, token_weights

    gen = torch.Generator().manual_seed(0)
    if layout == "packed":  # sparse global rollout ids, contiguous per rollout
        seq = torch.tensor([7] * 4 + [3] * 5 + [12] * 3)
        loss, mask = torch.randn(12, generator=gen), torch.rand(12, generator=gen) > 0.3
    else:
        seq, loss, mask = None, torch.randn(3, 5, generator=gen), torch.rand(3, 5, generator=gen) > 0.3
    counts = dict(global_num_seqs=3, global_num_tokens=int(mask.sum()))
    for name in AGGREGATION_NAMES:
        with SyncCounter() as counter:
            aggregate_loss(name, loss, mask, seq, max_response_tokens=5, **counts)
            token_weights(name, mask, seq, max_response_tokens=5, **counts)
        assert counter.total == 0, (name, counter.table())


def test_onpolicy_scoring_host_syncs_within_budget(tiny_checkpoint, single_rank, monkeypatch):
    """The scoring under the previous synced version's weights (zrl/trainer/onpolicy.py) runs on every RL
    step: the sample is chosen on the host, the weights move by asynchronous copies, and the forward and
    its statistics are the training microbatch's; the same budget holds."""
    ref = load_hf_checkpoint(tiny_checkpoint)
    cfg = ref.config
    batches = [synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg), num_groups=2, group_size=3, trainer_step=k, seed=3,
                                     model=ref, logprob_noise=0.2) for k in (0, 1)]
    settings = TrainerSettings(param_dtype="float32", token_budget=64, max_response_tokens=40, kernels="reference",
                               optimizer=Optimizer(muon=MuonSpec(lr=1e-2)), onpolicy_mismatch_tokens=16)
    worker = TrainerWorker(single_rank, tiny_checkpoint, settings)
    worker.weights_synced()
    worker.train_step(worker.share_of(batches[0]))  # the copy becomes version 0
    counters = []
    run = TrainerWorker._score_onpolicy

    def counted(self, *args, **kwargs):
        with SyncCounter() as counter:
            result = run(self, *args, **kwargs)
        counters.append(counter)
        return result

    monkeypatch.setattr(TrainerWorker, "_score_onpolicy", counted)
    metrics = worker.train_step(worker.share_of(batches[1]))  # tokens of versions 0 and 1
    assert metrics["mismatch/onpolicy_version_lag"] == 1 and metrics["mismatch/onpolicy_num_tokens"] > 0
    [counter] = counters
    budgeted = sum(n for (_, site), n in counter.by_site.items() if not any(k in site for k in KERNEL_REFERENCES))
    assert budgeted <= BUDGET, f"{budgeted} host syncs in the on-policy scoring:\n{counter.table()}"
