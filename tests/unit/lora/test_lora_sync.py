"""serving/lora_sync.py: the per-run choice between adapter-only and merged weight sync, vLLM's LoRA arguments,
and the engine's adapters by policy version (in-flight requests keep theirs; cache salts follow the version)."""

import numpy as np
import pytest

from serving import lora_sync
from serving.lora_sync import CPU_REASON, AdapterVersions, choose_weight_sync, engine_lora_args
from zrl.config.lora import LoRASpec, LoRATargets

ATTENTION = LoRASpec(rank=4, targets=LoRATargets(attention=True, experts=None, dense_mlp=False))


@pytest.fixture
def vllm_lora(monkeypatch):
    """vllm_supports_lora without importing vLLM: {architecture: supported}."""
    supported = {}
    monkeypatch.setattr(lora_sync, "vllm_supports_lora", lambda arch: supported.get(arch, False))
    return supported


def test_without_adapters_the_full_weights_travel(vllm_lora):
    assert choose_weight_sync("qwen3_moe", None, rollout_on_gpu=True).mode == "full"


def test_adapter_only_where_vllm_serves_the_model_on_the_device(vllm_lora):
    vllm_lora["Qwen3MoeForCausalLM"] = True
    assert choose_weight_sync("qwen3_moe", ATTENTION, rollout_on_gpu=True).mode == "adapter"
    assert choose_weight_sync("qwen3_moe", LoRASpec(), rollout_on_gpu=True).mode == "adapter"  # experts too
    on_cpu = choose_weight_sync("qwen3_moe", ATTENTION, rollout_on_gpu=False)
    assert (on_cpu.mode, on_cpu.reason) == ("merged", CPU_REASON)
    assert "triton" in on_cpu.line()
    no_class = choose_weight_sync("zaya", ATTENTION, rollout_on_gpu=True)
    assert no_class.mode == "merged" and "ZayaForCausalLM does not declare SupportsLoRA" in no_class.reason


def test_router_adapters_and_another_base_are_merged(vllm_lora):
    vllm_lora["Qwen3MoeForCausalLM"] = True
    router = LoRASpec(targets=LoRATargets(router=True))
    assert choose_weight_sync("qwen3_moe", router, rollout_on_gpu=True).mode == "merged"
    assert "router" in choose_weight_sync("qwen3_moe", router, rollout_on_gpu=True).reason
    other_base = choose_weight_sync("qwen3_moe", ATTENTION, rollout_on_gpu=True, base_is_served=False)
    assert other_base.mode == "merged" and "export" in other_base.reason


def test_the_recipe_can_force_a_mode(vllm_lora):
    vllm_lora["Qwen3MoeForCausalLM"] = True
    merged = ATTENTION.model_copy(update={"sync": "merged"})
    assert choose_weight_sync("qwen3_moe", merged, rollout_on_gpu=True).mode == "merged"
    forced = ATTENTION.model_copy(update={"sync": "adapter"})
    assert choose_weight_sync("qwen3_moe", forced, rollout_on_gpu=True).mode == "adapter"
    with pytest.raises(ValueError, match="model.lora.sync: adapter, but vLLM 0.32 runs"):
        choose_weight_sync("qwen3_moe", forced, rollout_on_gpu=False)


def test_vllm_declares_lora_for_its_moe_models_not_for_zaya():
    assert lora_sync.vllm_supports_lora("Qwen3MoeForCausalLM")
    assert lora_sync.vllm_supports_lora("Glm4MoeForCausalLM")
    assert not lora_sync.vllm_supports_lora("ZayaForCausalLM")


def test_engine_lora_args_name_the_adapted_modules():
    args = engine_lora_args("qwen3_moe", LoRASpec(rank=4))
    assert args["enable_lora"] and args["max_lora_rank"] == 8 and args["max_loras"] == 2  # vLLM's next rank up
    assert args["lora_target_modules"] == ["down_proj", "experts", "gate_proj", "k_proj", "o_proj", "q_proj",
                                           "up_proj", "v_proj"]
    assert engine_lora_args("qwen3_moe", ATTENTION)["lora_target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    with pytest.raises(ValueError, match="ranks up to 512"):
        engine_lora_args("qwen3_moe", LoRASpec(rank=600))


def test_adapter_versions_keep_in_flight_adapters_until_they_end(tmp_path):
    versions = AdapterVersions()
    assert versions.take() == (None, None)  # before the first sync: the base (B = 0, the same model)
    first, unused = versions.load(tmp_path / "v1", 1)
    assert (first.lora_name, first.lora_int_id, unused) == ("policy-v1", 2, [])
    assert versions.take()[0] == 1 and versions.take()[0] == 1
    _, unused = versions.load(tmp_path / "v2", 2)
    assert unused == [] and versions.held() == {1: 2}  # two requests still run with version 1
    assert versions.take()[0] == 2
    assert versions.give_back(1) == [] and versions.give_back(1) == [1]  # the last one ended: drop v1
    assert versions.give_back(2) == []  # the current adapter stays
    _, unused = versions.load(tmp_path / "v3", 3)
    assert unused == [2]
    with pytest.raises(ValueError, match="versions only grow"):
        versions.load(tmp_path / "v0", 2)
    assert versions.load_base() == [3] and versions.take() == (None, None)


class _FakeLLMEngine:
    """What RolloutEngine calls of vLLM's LLMEngine when requests are submitted, aborted and adapters loaded."""

    def __init__(self):
        self.requests, self.loras, self.removed = {}, [], []

    def add_request(self, external_id, request, params, lora_request=None):
        self.requests[external_id] = (request["cache_salt"], lora_request)
        return external_id

    def add_lora(self, request):
        self.loras.append(request)
        return True

    def remove_lora(self, lora_id):
        self.removed.append(lora_id)
        return True

    def abort_request(self, ids):
        pass

    def collective_rpc(self, method, args=()):
        return [{i: 0 for i in args[0]} if method == "positions_computed" else None]


def _engine_with_adapters():
    import itertools

    from serving.engine import RolloutEngine

    engine = RolloutEngine.__new__(RolloutEngine)  # its bookkeeping only: no vLLM engine on CPU serves MoE LoRA
    engine._engine, engine.version, engine._adapters = _FakeLLMEngine(), 0, AdapterVersions()
    engine._pending, engine._ids, engine._groups = {}, itertools.count(), itertools.count()
    return engine


def test_rollout_engine_requests_follow_their_adapter_version(tmp_path):
    from serving.engine import SamplingConfig

    engine, sampling = _engine_with_adapters(), SamplingConfig(max_tokens=4, seed=0)
    for name in ("v1", "v2", "v2-again"):
        (tmp_path / name).mkdir()
    base_group = engine.submit(np.arange(3), 1, sampling)
    engine.load_adapter(tmp_path / "v1", 1)
    first = engine.submit(np.arange(3), 2, sampling)
    engine.load_adapter(tmp_path / "v2", 2)
    second = engine.submit(np.arange(3), 1, sampling)
    fake = engine._engine
    salts = [(salt, None if r is None else r.lora_name) for salt, r in fake.requests.values()]
    assert salts == [("policy-v0", None), ("policy-v1", "policy-v1"), ("policy-v1", "policy-v1"),
                     ("policy-v2", "policy-v2")]
    # In flight across the load: version 1's requests keep their adapter and one version segment.
    assert [p.segments[-1].version for p in engine._pending.values()] == [0, 1, 1, 2]
    assert fake.removed == [] and (tmp_path / "v1").exists()
    engine.abort(base_group)
    engine.abort(first)  # the last requests of version 1 ended: vLLM drops it, its directory goes
    assert fake.removed == [2] and not (tmp_path / "v1").exists()
    engine.abort(second)
    assert fake.removed == [2] and (tmp_path / "v2").exists()  # the current version stays loaded
    assert engine.load_adapter(tmp_path / "v2-again", 2).num_bytes == 0  # the same version again: nothing loaded
    assert not (tmp_path / "v2-again").exists() and fake.loras[-1].lora_name == "policy-v2"
