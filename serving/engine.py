"""Rollout-worker-facing wrapper around one in-process vLLM engine serving an MoE policy.

`RolloutEngine` drives vLLM's `LLMEngine` step by step so that a weight update can land between two
steps while requests are in flight (PipelineRL "keep": running sequences continue with their KV cache
and CCA state). For every sample it returns prompt and generated token ids, the sampled tokens'
logprobs, the experts chosen by every MoE layer for every token, the finish reason and the policy
version of every generated token. Served models, by config.json's `model_type` (served_models.py):
`zaya` (ZAYA1 MoE++, the out-of-tree model of zaya_vllm.py) and `qwen3_moe` (vLLM's built-in Qwen3-MoE).

The logprobs are vLLM's "processed_logprobs", always: each token's log-probability under the
distribution it was actually sampled from (temperature, then min-p, top-k, top-p). The trainer takes
its logprobs under the same distribution (zrl.modeling.logprobs, `SamplingDistribution`), which is what
makes the two comparable; a temperature in (0, 0.01), which vLLM would silently raise to 0.01, is
refused for that reason.

Invariants:
- A generated token's version is the engine's version during the step that sampled it; versions are
  stored as segments (first token index, version), one per change.
- `routing` is [Tp + Tr, routing_width] uint8: zaya L columns, one expert per MoE layer with the skip
  expert as id E; qwen3_moe L * k columns, layer-major (layer l owns columns l*k .. l*k + k - 1, the k ids in
  the router's order), dense layers' columns NO_ROUTE. The row of a token the engine never computed
  (the last sampled token) is zrl.types.NO_ROUTE (255), which the trainer routes natively.
- Sample i of the j-th prompt of `generate` uses seed `seed + j * num_samples + i` when a seed is set.
Shapes (docs/shapes.md): Tp prompt tokens, Tr generated tokens, L (MoE) layers, k experts per token.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from serving.lora_sync import AdapterVersions
from serving.served_models import served_model
from serving.worker_ext import WeightStream
from zrl.types import NO_ROUTE

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "serving.worker_ext.RolloutWorkerExtension"
MIN_TEMPERATURE = 0.01  # vLLM's floor for a non-greedy temperature (SamplingParams)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks comparing equal token counts)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (vLLM raises smaller ones "
                             f"to {MIN_TEMPERATURE}), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.stop, str):
            raise TypeError("stop must be a tuple of strings, not a string")


@dataclasses.dataclass(frozen=True)
class VersionSegment:
    start: int  # index of the first generated token sampled under `version`
    version: int


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    prompt_ids: np.ndarray  # [Tp] int64
    token_ids: np.ndarray  # [Tr] int64
    logprobs: np.ndarray  # [Tr] float32, logprob of each sampled token
    routing: np.ndarray  # [Tp + Tr, routing_width] uint8, experts per token and layer (module docstring; NO_ROUTE = not computed)
    finish_reason: str  # "stop", "length" or "abort"
    version_segments: tuple[VersionSegment, ...]
    text: str

    def token_versions(self) -> np.ndarray:
        """[Tr] int64: the policy version of every generated token, expanded from the segments."""
        versions = np.empty(len(self.token_ids), dtype=np.int64)
        bounds = [s.start for s in self.version_segments[1:]] + [len(self.token_ids)]
        for segment, stop in zip(self.version_segments, bounds):
            versions[segment.start: stop] = segment.version
        return versions


@dataclasses.dataclass(frozen=True)
class FinishedSample:
    group_id: int
    sample_index: int
    output: SampleOutput


@dataclasses.dataclass(frozen=True)
class WeightUpdateStats:
    version: int
    seconds: float  # wall time of the in-place load (the engine is paused for this long)
    num_bytes: int  # bytes of the state dict loaded (0 for a path)


@dataclasses.dataclass
class _Pending:
    group_id: int
    sample_index: int
    internal_id: str
    prompt_ids: np.ndarray
    decode_text: bool  # vLLM does not detokenize (no stop strings): decode the text at the end
    segments: list[VersionSegment]
    adapter_version: int | None = None  # the adapter it runs with (adapter-only sync), held until it ends


class RolloutEngine:
    """One vLLM engine driven step by step; not thread-safe (call from one thread)."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        policy_version: int = 0,
        prefix_caching: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        """prefix_caching: the samples of a group (and later groups of the same prompt under the same policy
        version) reuse the prompt's computed KV blocks (and ZAYA's CCA state) instead of prefilling it again;
        exact (serving/cca_state.py), and each reused position's routing is the one recorded when it was computed.
        `engine_kwargs` with vLLM's `enable_lora` (serving.lora_sync.engine_lora_args): the engine serves the policy's
        adapters by version (`load_adapter`)."""
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from serving.plugin import register

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            logger.warning("VLLM_ENABLE_V1_MULTIPROCESSING is not 0: weight updates and routing then "
                           "cross a process boundary by serialisation")
        model_type = _local_model_type(model)
        if model_type is not None:  # refused before vLLM starts; else the worker refuses it (worker_ext.py)
            served_model(model_type)
        register()  # the ZAYA model, in this process; vLLM's own processes load it through the entry point
        # The routing capture hooks vLLM's V1 model runner (worker_ext.py); vLLM picks V2 by default on CUDA.
        if os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("0", "false", "False"):
            raise ValueError("VLLM_USE_V2_MODEL_RUNNER: the rollout engine needs vLLM's V1 model runner "
                             "(its routing capture hooks it); unset the variable or set it to 0")
        args = EngineArgs(
            model=str(model), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, seed=seed, enforce_eager=True,
            enable_prefix_caching=prefix_caching, logprobs_mode="processed_logprobs", max_logprobs=0,
            worker_extension_cls=WORKER_EXTENSION, **engine_kwargs)
        self._engine = LLMEngine.from_engine_args(args)
        self._tokenizer = self._engine.get_tokenizer()
        self.routing_width = self._rpc("start_routing_capture")  # columns of a routing row: L (zaya), L * k (qwen3_moe)
        self.version = policy_version
        self._adapters = AdapterVersions() if engine_kwargs.get("enable_lora") else None
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._groups = itertools.count()

    # ------------------------------------------------------------------ requests

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + generated tokens) the engine accepts."""
        return self._engine.model_config.max_model_len

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def in_flight(self) -> dict[tuple[int, int], int]:
        """(group id, sample index) -> tokens generated so far, for every unfinished sample."""
        generated = self._generated_so_far()
        return {(p.group_id, p.sample_index): generated[k] for k, p in self._pending.items()}

    def submit(self, prompt_ids: Sequence[int], num_samples: int, sampling: SamplingConfig,
               seed: int | None = None) -> int:
        """Queue `num_samples` samples of one prompt; returns the group id their outputs carry.

        Sample i uses seed `seed + i` (default: `sampling.seed`); no seed means fresh randomness.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("prompt_ids must be a non-empty 1-D sequence of token ids")
        base_seed = sampling.seed if seed is None else seed
        group_id = next(self._groups)
        # Stop strings need vLLM's incremental detokenizer; without them the text is decoded once at
        # the end, which spares vLLM decoding every token (and its logprob entry) at every step.
        detokenize = bool(sampling.stop)
        for i in range(num_samples):
            adapter_version, lora_request = self._adapters.take() if self._adapters is not None else (None, None)
            params = SamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                min_p=sampling.min_p, max_tokens=sampling.max_tokens, stop=list(sampling.stop) or None,
                seed=None if base_seed is None else base_seed + i, logprobs=0, flat_logprobs=True,
                detokenize=detokenize, output_kind=RequestOutputKind.FINAL_ONLY, ignore_eos=sampling.ignore_eos)
            external_id = f"zrl-{next(self._ids)}"
            # The salt keeps a prefix computed under one policy version from serving another one.
            # (With adapters: the version of the adapter the request runs with, which is the current one.)
            salt_version = self.version if adapter_version is None else adapter_version
            request = {"prompt_token_ids": prompt.tolist(), "cache_salt": f"policy-v{salt_version}"}
            internal_id = self._engine.add_request(external_id, request, params, lora_request=lora_request)
            self._pending[external_id] = _Pending(group_id, i, internal_id, prompt, not detokenize,
                                                  [VersionSegment(0, self.version)], adapter_version)
        return group_id

    def step(self) -> list[FinishedSample]:
        """Run one engine step; returns the samples that finished in it."""
        finished = [(output, self._pending.pop(output.request_id)) for output in self._engine.step()
                    if output.finished and output.request_id in self._pending]
        if not finished:
            return []
        self._release_adapters(p for _, p in finished)
        tables = self._rpc("pop_routing", [p.internal_id for _, p in finished])
        return [FinishedSample(p.group_id, p.sample_index, self._sample_output(o, p, tables[p.internal_id]))
                for o, p in finished]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        num_samples: int,
        sampling: SamplingConfig,
        between_steps: Callable[[RolloutEngine], None] | None = None,
    ) -> list[list[SampleOutput]]:
        """G = num_samples samples of each prompt, in prompt order then sample order.

        `between_steps(self)` runs after every engine step (e.g. to apply a weight update mid-flight).
        """
        if self._pending:
            raise RuntimeError("generate() needs an idle engine; drain or abort submitted requests first")
        groups = []
        for j, prompt in enumerate(prompts):
            seed = None if sampling.seed is None else sampling.seed + j * num_samples
            groups.append(self.submit(prompt, num_samples, sampling, seed=seed))
        slot = {group: j for j, group in enumerate(groups)}
        results: list[list[SampleOutput | None]] = [[None] * num_samples for _ in prompts]
        while self._pending:
            for sample in self.step():
                results[slot[sample.group_id]][sample.sample_index] = sample.output
            if between_steps is not None:
                between_steps(self)
        return results  # type: ignore[return-value]

    def abort(self, group_id: int) -> None:
        """Drop every unfinished sample of a group (no output is returned for them)."""
        external = [k for k, p in self._pending.items() if p.group_id == group_id]
        if not external:
            return
        self._engine.abort_request(external)
        self._rpc("discard_routing", [self._pending[k].internal_id for k in external])
        self._release_adapters([self._pending.pop(k) for k in external])  # a list: popped with or without adapters

    def abort_all(self) -> None:
        """Drop every unfinished sample of every group (no output is returned for them)."""
        if self._pending:
            self._engine.abort_request(list(self._pending))
            self._rpc("discard_routing", [p.internal_id for p in self._pending.values()])
            self._release_adapters(self._pending.values())
            self._pending.clear()

    # ------------------------------------------------------------------ weights

    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightStream | str | Path | Any,
                       version: int | None = None) -> WeightUpdateStats:
        """Load new weights in place between two steps and bump the version.

        `weights`: a complete state dict with the served model's HF keys (in-process tensors), a Ray ObjectRef
        of one, a `WeightStream` (loaded as its tensors arrive; in-process engine only) or a
        checkpoint directory. `version` defaults to the current version + 1.
        With vLLM's multi-process engine, tensors cannot cross its two process hops: a state dict is
        then written to a temporary safetensors directory and loaded from there (included in `seconds`).
        """
        num_bytes = 0
        if isinstance(weights, (str, Path)):
            payload: Mapping[str, torch.Tensor] | WeightStream | str = str(weights)
        elif isinstance(weights, WeightStream):
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
                raise RuntimeError("a streamed weight update needs the in-process engine "
                                   "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
            payload = weights
        else:
            if not isinstance(weights, Mapping):
                import ray  # a Ray ObjectRef; resolved here, in the engine's process

                weights = ray.get(weights)
            payload = weights
            num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        start = time.perf_counter()
        if isinstance(payload, Mapping) and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            with tempfile.TemporaryDirectory(prefix="zrl-weights-") as tmp:
                save_file({k: t.detach().cpu().contiguous() for k, t in payload.items()},
                          str(Path(tmp) / "model.safetensors"))
                self._rpc("load_weights_in_place", tmp)
        else:
            self._rpc("load_weights_in_place", payload)
        seconds = time.perf_counter() - start
        self.version = self.version + 1 if version is None else version
        if self._adapters is not None:  # new base weights: new requests run on them alone
            self._remove_adapters(self._adapters.load_base())
        for external_id, generated in self._generated_so_far().items():
            segments = self._pending[external_id].segments
            while segments and segments[-1].start >= generated:  # no token sampled under that version
                segments.pop()
            segments.append(VersionSegment(generated, self.version))
        return WeightUpdateStats(version=self.version, seconds=seconds, num_bytes=num_bytes)

    @property
    def serves_adapters(self) -> bool:
        """Whether the engine serves the policy's adapters with vLLM's LoRA (adapter-only weight sync)."""
        return self._adapters is not None

    def load_adapter(self, path: str | Path, version: int, num_bytes: int = 0) -> WeightUpdateStats:
        """Make PEFT adapter directory `path` policy version `version`: requests submitted from now on run
        with it (LoRARequest `policy-v<version>`, serving.lora_sync.AdapterVersions), requests in flight keep
        the adapter they started with until they end, so their tokens keep their version. The engine owns
        `path` from now on and deletes it when no request uses the version any more."""
        if self._adapters is None:
            raise RuntimeError("load_adapter: the engine was started without vLLM's LoRA (enable_lora)")
        start = time.perf_counter()
        if version == self._adapters.current:  # a version's adapter is that version's: already served
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            return WeightUpdateStats(version=version, seconds=time.perf_counter() - start, num_bytes=0)
        request, unused = self._adapters.load(path, version)
        self._engine.add_lora(request)
        self._remove_adapters(unused)
        self.version = version
        return WeightUpdateStats(version=version, seconds=time.perf_counter() - start, num_bytes=num_bytes)

    def _release_adapters(self, finished) -> None:
        if self._adapters is not None:
            for p in list(finished):
                self._remove_adapters(self._adapters.give_back(p.adapter_version))

    def _remove_adapters(self, versions: list[int]) -> None:
        import shutil

        for version in versions:
            self._engine.remove_lora(self._adapters.request(version).lora_int_id)
            shutil.rmtree(self._adapters.path(version), ignore_errors=True)
            self._adapters.forget(version)

    def close(self) -> None:
        """Abort what is in flight and shut the engine down.

        vLLM's in-process shutdown also tears down its process-global distributed state, so close an
        engine only when no other in-process vLLM engine of this process is still to be used.
        """
        if self._pending:
            self._engine.abort_request(list(self._pending))
            self._pending.clear()  # the routing tables go with the engine
        engine, self._engine = self._engine, None
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()

    # ------------------------------------------------------------------ helpers

    def _rpc(self, method: str, *args: Any) -> Any:
        return self._engine.collective_rpc(method, args=args)[0]

    def _generated_so_far(self) -> dict[str, int]:
        """external id -> tokens sampled so far, for every pending sample.

        The engine has sampled one token per position it computed at or after the last prompt token
        (a partial prefill chunk samples nothing kept), so the count follows from the positions the
        worker's routing recorder has seen; recomputation after preemption does not lower it.
        """
        computed = self._rpc("positions_computed", [p.internal_id for p in self._pending.values()])
        return {k: max(0, computed[p.internal_id] - len(p.prompt_ids) + 1) for k, p in self._pending.items()}

    def _sample_output(self, output, pending: _Pending, table_bytes: bytes) -> SampleOutput:
        completion = output.outputs[0]
        table = np.frombuffer(table_bytes, dtype=np.uint8).reshape(-1, self.routing_width)
        token_ids = np.asarray(completion.token_ids, dtype=np.int64)
        num_rows = len(pending.prompt_ids) + len(token_ids)
        routing = np.full((num_rows, self.routing_width), NO_ROUTE, dtype=np.uint8)
        rows = min(num_rows, table.shape[0])
        routing[:rows] = table[:rows]
        text = (self._tokenizer.decode(token_ids.tolist(), skip_special_tokens=True) if pending.decode_text
                else completion.text)
        segments = tuple(s for s in pending.segments if s.start < max(len(token_ids), 1))
        return SampleOutput(
            prompt_ids=pending.prompt_ids, token_ids=token_ids,
            logprobs=_sampled_logprobs(completion.logprobs, token_ids), routing=routing,
            finish_reason=completion.finish_reason or "abort", version_segments=segments, text=text)


def _local_model_type(model: str | Path) -> str | None:
    """config.json's model_type of a local checkpoint directory; None for anything else (a Hub id)."""
    config = Path(model) / "config.json"
    return json.loads(config.read_text()).get("model_type", "") if config.is_file() else None


def _sampled_logprobs(flat, token_ids: np.ndarray) -> np.ndarray:
    """[T] float32: the sampled token's logprob at each position of a FlatLogprobs (logprobs=0).

    vLLM puts the sampled token first in each position's entries; that is checked, not assumed.
    """
    if flat is None:
        raise RuntimeError("vLLM returned no logprobs although logprobs=0 was requested")
    first = np.asarray(flat.start_indices[: len(token_ids)], dtype=np.int64)
    if len(first) != len(token_ids) or not np.array_equal(np.asarray(flat.token_ids)[first], token_ids):
        raise RuntimeError("vLLM's logprobs do not start with the sampled tokens")
    return np.asarray(flat.logprobs, dtype=np.float32)[first]
