"""The pieces of the vLLM integration that need no engine: stateful CCA convolutions and value shift,
the worker-side routing recorder, the rewindable CPU generator, and the wrapper's value types."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from serving.cca_state import request_layout, stateful_causal_convs, stateful_value_shift
from serving.engine import SampleOutput, SamplingConfig, VersionSegment
from serving.routing_capture import RoutingRecorder
from serving.worker_ext import RolloutWorkerExtension, _make_cpu_generators_rewindable
from zrl.types import NO_ROUTE

pytestmark = pytest.mark.integration


def _convs(channels: int, groups: int, k0: int = 2, k1: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    return (nn.Conv1d(channels, channels, k0, groups=channels).double(),
            nn.Conv1d(channels, channels, k1, groups=groups).double())


def _full_sequence_convs(x: torch.Tensor, dw: nn.Conv1d, gr: nn.Conv1d) -> torch.Tensor:
    """Reference: both convolutions over one whole sequence x [T, C], zero history (left padding)."""
    history = dw.kernel_size[0] - 1 + gr.kernel_size[0] - 1
    h = F.pad(x.t()[None], (history, 0))
    return gr(dw(h))[0].t()


def test_request_layout_maps_tokens_to_requests():
    request, local = request_layout(torch.tensor([0, 1, 4, 4 + 2]), 6)
    assert request.tolist() == [0, 1, 1, 1, 2, 2]
    assert local.tolist() == [0, 0, 1, 2, 0, 1]


def test_convs_hand_computed_single_channel():
    # Two channels in two groups (so each "grouped" filter is one scalar per tap), k0 = k1 = 2.
    dw, gr = _convs(2, 2)
    with torch.no_grad():
        dw.weight.copy_(torch.tensor([[[1.0, 2.0]], [[0.0, 1.0]]], dtype=torch.float64))  # a0, a1 per channel
        dw.bias.copy_(torch.tensor([0.5, 0.0], dtype=torch.float64))
        gr.weight.copy_(torch.tensor([[[3.0, 1.0]], [[1.0, 0.0]]], dtype=torch.float64))  # g0, g1 per channel
        gr.bias.copy_(torch.tensor([0.0, 10.0], dtype=torch.float64))
    x = torch.tensor([[1.0, 5.0], [2.0, 6.0], [3.0, 7.0]], dtype=torch.float64)  # [T=3, C=2]
    out, history = stateful_causal_convs(x, torch.zeros(1, 2, 2, dtype=torch.float64),
                                         torch.tensor([0, 3]), dw, gr)
    # Channel 0: dw(t) = x(t-1) + 2 x(t) + 0.5 with x(<0) = 0 -> dw(-1) = 0.5, dw(0) = 2.5, dw(1) = 5.5,
    # dw(2) = 8.5; out(t) = 3 dw(t-1) + dw(t) -> 4.0, 13.0, 25.0.
    # Channel 1: dw(t) = x(t) (dw(-1) = 0); out(t) = dw(t-1) + 10 -> 10, 15, 16.
    assert out[:, 0].tolist() == [4.0, 13.0, 25.0]
    assert out[:, 1].tolist() == [10.0, 15.0, 16.0]
    assert history[0].tolist() == [[2.0, 6.0], [3.0, 7.0]]  # the last P = 2 inputs


@pytest.mark.parametrize("chunks", [(11,), (3, 1, 5, 2), (1,) * 11, (2, 9)])
def test_chunked_convs_equal_the_whole_sequence(chunks):
    channels, groups = 12, 3
    dw, gr = _convs(channels, groups)
    x = torch.randn(sum(chunks), channels, dtype=torch.float64)
    expected = _full_sequence_convs(x, dw, gr)
    history = torch.zeros(1, 2, channels, dtype=torch.float64)
    outs = []
    for chunk in x.split(list(chunks)):
        out, history = stateful_causal_convs(chunk, history, torch.tensor([0, len(chunk)]), dw, gr)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=0, atol=1e-12)


def test_batched_requests_use_their_own_history():
    channels, groups = 6, 2
    dw, gr = _convs(channels, groups, k0=3, k1=2)  # history P = 3
    seqs = [torch.randn(n, channels, dtype=torch.float64) for n in (7, 2, 5)]
    split = [4, 1, 2]  # first chunk of each request; the rest is batched together afterwards
    histories, firsts = [], []
    for seq, k in zip(seqs, split):
        out, hist = stateful_causal_convs(seq[:k], torch.zeros(1, 3, channels, dtype=torch.float64),
                                          torch.tensor([0, k]), dw, gr)
        histories.append(hist)
        firsts.append(out)
    rest = [seq[k:] for seq, k in zip(seqs, split)]
    cu = torch.tensor([0] + np.cumsum([len(r) for r in rest]).tolist())
    out, new_history = stateful_causal_convs(torch.cat(rest), torch.cat(histories), cu, dw, gr)
    for i, seq in enumerate(seqs):
        expected = _full_sequence_convs(seq, dw, gr)
        got = torch.cat([firsts[i], out[cu[i]: cu[i + 1]]])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        padded = F.pad(seq, (0, 0, 3, 0))  # zero rows before the first token
        torch.testing.assert_close(new_history[i], padded[-3:], rtol=0, atol=0)


def test_history_of_a_chunk_shorter_than_the_history_keeps_older_rows():
    dw, gr = _convs(4, 2)
    history = torch.arange(8, dtype=torch.float64).view(1, 2, 4)
    token = torch.full((1, 4), 100.0, dtype=torch.float64)
    _, new_history = stateful_causal_convs(token, history, torch.tensor([0, 1]), dw, gr)
    assert new_history[0].tolist() == [[4.0, 5.0, 6.0, 7.0], [100.0] * 4]


def test_history_length_must_match_the_kernels():
    dw, gr = _convs(4, 2)
    with pytest.raises(ValueError, match="history holds 3 tokens"):
        stateful_causal_convs(torch.zeros(2, 4), torch.zeros(1, 3, 4), torch.tensor([0, 2]), dw, gr)


def test_value_shift_across_chunks_and_requests():
    value = torch.tensor([[1.0], [2.0], [3.0], [10.0], [20.0]])
    previous = torch.tensor([[-1.0], [-2.0]])  # the value before each request's chunk
    shifted, last = stateful_value_shift(value, previous, torch.tensor([0, 3, 5]))
    assert shifted[:, 0].tolist() == [-1.0, 1.0, 2.0, -2.0, 10.0]
    assert last[:, 0].tolist() == [3.0, 20.0]


def test_recorder_places_rows_by_position_and_counts_recomputation():
    recorder = RoutingRecorder(num_layers=2, max_positions=64, page_rows=4)
    rows = np.array([[0, 1], [2, 3], [4, 0], [1, 1]], dtype=np.uint8)
    # Step 1: request a prefills positions 0..2, request b decodes position 5.
    recorder.record(["a", "b"], np.array([0, 3, 4]), np.array([0, 1, 2, 5]), rows)
    assert recorder.positions_computed("a") == 3 and recorder.positions_computed("b") == 6
    # Step 2: request a is recomputed from scratch (preempted): positions 0..1 again.
    recorder.record(["a"], np.array([0, 2]), np.array([0, 1]), rows[[3, 3]])
    assert recorder.recomputed_rows == 2
    assert recorder.positions_computed("a") == 3  # recomputation does not lower it
    assert recorder.pop("a").tolist() == [[1, 1], [1, 1], [4, 0]]
    table_b = recorder.pop("b")
    assert table_b.shape == (6, 2) and (table_b[:5] == NO_ROUTE).all() and table_b[5].tolist() == [1, 1]
    assert recorder.pop("never-seen").shape == (0, 2)
    assert len(recorder) == 0


def test_recorder_pages_grow_and_are_reused_clean():
    recorder = RoutingRecorder(num_layers=1, max_positions=40, page_rows=4)
    ids = [f"r{i}" for i in range(20)]  # more requests and pages than the initial pool holds
    positions = np.arange(20) * 2  # request i writes position 2 i (page i // 2)
    recorder.record(ids, np.arange(21), positions, (np.arange(20, dtype=np.uint8) + 1)[:, None])
    for i, req in enumerate(ids):
        table = recorder.pop(req)
        assert table.shape == (2 * i + 1, 1) and table[2 * i, 0] == i + 1 and (table[: 2 * i] == NO_ROUTE).all()
    recorder.record(["new"], np.array([0, 1]), np.array([3]), np.array([[9]], np.uint8))
    assert recorder.pop("new")[:, 0].tolist() == [NO_ROUTE] * 3 + [9]  # freed pages came back clean
    with pytest.raises(ValueError, match="beyond"):
        recorder.record(["x"], np.array([0, 1]), np.array([40]), np.zeros((1, 1), np.uint8))


def test_recorder_gives_a_prefix_cache_hit_the_rows_of_the_slots_it_reuses():
    """With prefix caching, rows are also kept per KV slot; a request whose first computed position is p > 0
    gets rows 0..p-1 from the slots its block table names, including slots written in the same step."""
    recorder = RoutingRecorder(num_layers=1, max_positions=32, page_rows=4, kv_block_size=4)
    rows = np.arange(1, 7, dtype=np.uint8)[:, None]
    # Step 1: a prefills 0..5 into KV blocks 3 (positions 0-3) and 7 (4-5).
    recorder.record(["a"], np.array([0, 6]), np.arange(6), rows, kv_blocks=np.array([[3, 7]]))
    # Step 2: b reuses block 3 and computes 4..5 in block 9; c reuses 3 and 9 (b's block, same step) at 8.
    recorder.record(["b", "c"], np.array([0, 2, 3]), np.array([4, 5, 8]), np.array([[20], [21], [30]], np.uint8),
                    kv_blocks=np.array([[3, 9, 0], [3, 9, 11]]))
    assert recorder.pop("b")[:, 0].tolist() == [1, 2, 3, 4, 20, 21]
    assert recorder.pop("c")[:, 0].tolist() == [1, 2, 3, 4, 20, 21, NO_ROUTE, NO_ROUTE, 30]
    assert recorder.cached_rows == 4 + 8
    # A request that has run before (recomputed after preemption from a cached block) keeps its own rows.
    recorder.record(["a"], np.array([0, 1]), np.array([4]), np.array([[9]], np.uint8), kv_blocks=np.array([[3, 7]]))
    assert recorder.pop("a")[:, 0].tolist() == [1, 2, 3, 4, 9, 6] and recorder.cached_rows == 12


def test_recorder_records_later_steps_in_order_from_copies():
    """record_later keeps copies of the step's tensors (the runner reuses its buffers) and records the step
    at the next one or before any read; the result equals recording at once."""
    now, later = RoutingRecorder(2, 64, page_rows=4), RoutingRecorder(2, 64, page_rows=4)
    steps = [(["a", "b"], np.array([0, 3, 4]), [0, 1, 2, 5], [[0, 1], [2, 3], [4, 0], [1, 1]]),
             (["a"], np.array([0, 2]), [0, 1], [[7, 7], [7, 7]]),  # recomputation of a, after preemption
             (["b"], np.array([0, 1]), [6], [[3, 2]])]
    positions_buffer, routing_buffer = torch.zeros(8, dtype=torch.int64), torch.zeros(8, 2, dtype=torch.uint8)
    for req_ids, qsl, positions, routing in steps:
        now.record(req_ids, qsl, np.array(positions), np.array(routing, np.uint8))
        n = len(positions)
        positions_buffer[:n], routing_buffer[:n] = torch.tensor(positions), torch.tensor(routing, dtype=torch.uint8)
        later.record_later(req_ids, qsl, positions_buffer[:n], routing_buffer[:n])
        positions_buffer.fill_(63)  # the runner writes its next step into the same buffers
        routing_buffer.fill_(9)
    assert later._pending  # the last step waits until something reads
    assert later.positions_computed("b") == 7 and not later._pending
    assert later.recomputed_rows == now.recomputed_rows == 2
    for req in ("a", "b"):
        assert later.pop(req).tolist() == now.pop(req).tolist()


class HostReads(torch.Tensor):
    """A tensor that counts the calls that bring device data to the host (each a device sync on CUDA)."""

    reads = 0

    def _count(self, name, *args, **kwargs):
        HostReads.reads += 1
        return getattr(torch.Tensor, name)(self.as_subclass(torch.Tensor), *args, **kwargs)

    def cpu(self, *args, **kwargs):
        return self._count("cpu", *args, **kwargs)

    def numpy(self, *args, **kwargs):
        return self._count("numpy", *args, **kwargs)

    def item(self):
        return self._count("item")

    def tolist(self):
        return self._count("tolist")


def test_capture_hook_reads_nothing_back_during_the_step():
    """The engine step's capture hook hands the step's routing and positions over without bringing them to
    the host (was: two `.cpu()` per step, each a device sync on CUDA); they reach the recorder later."""
    from types import SimpleNamespace

    routing = torch.tensor([[1, 0], [2, 1], [0, 0]], dtype=torch.uint8)
    model = SimpleNamespace(model=SimpleNamespace(layers=[None, None]), last_routing=None)

    def model_forward(input_ids, positions):
        model.last_routing = routing.as_subclass(HostReads)
        return "hidden"

    runner = SimpleNamespace(
        get_model=lambda: model, _model_forward=model_forward,
        model_config=SimpleNamespace(max_model_len=64, hf_config=SimpleNamespace(model_type="zaya")),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        cache_config=SimpleNamespace(enable_prefix_caching=False), requests={},
        input_batch=SimpleNamespace(generators={}, num_reqs=2, req_ids=["a", "b"]),
        query_start_loc=SimpleNamespace(np=np.array([0, 2, 3])))
    worker = SimpleNamespace(model_runner=runner)
    assert RolloutWorkerExtension.start_routing_capture(worker) == 2
    HostReads.reads = 0
    positions = torch.tensor([0, 1, 5, 99]).as_subclass(HostReads)  # the runner's buffer: more rows than tokens
    assert runner._model_forward(None, positions) == "hidden"
    assert HostReads.reads == 0
    assert RolloutWorkerExtension.positions_computed(worker, ["a", "b"]) == {"a": 2, "b": 6}
    table = np.frombuffer(RolloutWorkerExtension.pop_routing(worker, ["b"])["b"], np.uint8).reshape(-1, 2)
    assert table[5].tolist() == [0, 0] and (table[:5] == NO_ROUTE).all()


def test_rewindable_generator_undoes_one_step_of_sampling():
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(123)
    generators = {0: gen}
    requests = {"r": SimpleNamespace(generator=gen)}
    _make_cpu_generators_rewindable(SimpleNamespace(generators=generators, req_ids=["r"]), requests)
    assert requests["r"].generator is generators[0]  # a preempted request re-enters with this one
    first = torch.empty(4).exponential_(generator=generators[0])
    generators[0].set_offset(generators[0].get_offset() - 4)  # what vLLM does for a discarded sample
    again = torch.empty(4).exponential_(generator=generators[0])
    assert torch.equal(first, again)
    expected = torch.empty(4).exponential_(generator=torch.Generator().manual_seed(123))
    assert torch.equal(first, expected)  # the swap kept the seeded state


def test_token_versions_expand_segments():
    sample = SampleOutput(prompt_ids=np.array([1]), token_ids=np.arange(6), logprobs=np.zeros(6, np.float32),
                          routing=np.zeros((7, 2), np.uint8), finish_reason="length",
                          version_segments=(VersionSegment(0, 3), VersionSegment(2, 4), VersionSegment(5, 6)),
                          text="")
    assert sample.token_versions().tolist() == [3, 3, 4, 4, 4, 6]


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=1, temperature=-1.0), "temperature"),
    (dict(max_tokens=1, top_p=0.0), "top_p"), (dict(max_tokens=1, top_k=-1), "top_k"),
    (dict(max_tokens=1, min_p=1.5), "min_p"),
])
def test_sampling_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_plugin_registers_zaya_and_prefix_caching_takes_the_align_state_mode(serving_checkpoint):
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs

    from serving.plugin import ARCHITECTURE, register

    register()
    register()  # idempotent
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    config = EngineArgs(model=str(serving_checkpoint), enable_prefix_caching=True, enforce_eager=True,
                        max_model_len=128, block_size=32).create_engine_config()
    assert config.model_config.is_hybrid  # the CCA state lives in vLLM's Mamba-style state cache
    assert config.cache_config.mamba_cache_mode == "align"  # the state saved at every KV block boundary
    assert config.cache_config.mamba_block_size == 32
    off = EngineArgs(model=str(serving_checkpoint), enable_prefix_caching=False, enforce_eager=True,
                     max_model_len=128).create_engine_config()
    assert off.cache_config.mamba_cache_mode == "none"


def test_model_refuses_prefix_caching_that_would_need_a_mid_block_state():
    from types import SimpleNamespace

    from serving.zaya_vllm import _check_supported

    def config(**cache):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                               model_config=SimpleNamespace(enforce_eager=True),
                               cache_config=SimpleNamespace(**{"enable_prefix_caching": True, "mamba_cache_mode": "align",
                                                               "enable_mamba_shared_prefix_checkpoint": False, **cache}))

    _check_supported(config())
    with pytest.raises(ValueError, match="'align'"):
        _check_supported(config(mamba_cache_mode="all"))
    with pytest.raises(ValueError, match="shared_prefix"):
        _check_supported(config(enable_mamba_shared_prefix_checkpoint=True))
