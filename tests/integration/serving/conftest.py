"""Fixtures for the vLLM serving tests: a tiny ZAYA checkpoint with non-trivial routing, one fp32 and
one bf16 engine per session (and one fp32 engine with prefix caching), and zrl.moepp reference models on
the same weights."""

import pytest
import torch


@pytest.fixture(scope="session")
def serving_checkpoint(tmp_path_factory):
    from serving.testing_assets import build_serving_checkpoint

    return build_serving_checkpoint(tmp_path_factory.mktemp("zaya") / "ckpt")


def _engine(path, dtype):
    from serving.engine import RolloutEngine
    from serving_testlib import ENGINE_KWARGS

    # One intra-op thread: with two on a 2-core machine shared with other processes, vLLM's CPU steps
    # spend most of their time in OpenMP barriers (measured 10-20x slower and erratic). vLLM's CPU
    # worker turns torch.set_num_threads into a no-op for the whole process once an engine exists,
    # so this takes effect only before the session's first engine (and stays for later tests).
    torch.set_num_threads(1)
    return RolloutEngine(path, dtype=dtype, seed=0, **ENGINE_KWARGS)


@pytest.fixture(scope="session")
def fp32_engine(serving_checkpoint):
    engine = _engine(serving_checkpoint, "float32")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def cached_fp32_engine(serving_checkpoint):
    """The fp32 engine's settings with prefix caching on, and KV blocks enough that nothing is preempted."""
    from serving.engine import RolloutEngine
    from serving_testlib import ENGINE_KWARGS

    engine = RolloutEngine(serving_checkpoint, dtype="float32", seed=0, prefix_caching=True,
                           **{**ENGINE_KWARGS, "num_gpu_blocks_override": 64})
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def bf16_engine(serving_checkpoint):
    engine = _engine(serving_checkpoint, "bfloat16")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def updated_weights(serving_checkpoint):
    """HF-keyed tensors standing for "the trainer's next weights" (the checkpoint plus noise)."""
    from serving.testing_assets import perturbed_state_dict

    return perturbed_state_dict(serving_checkpoint, seed=2, scale=0.3)


@pytest.fixture(scope="session")
def fresh_bf16_engine(serving_checkpoint, updated_weights, tmp_path_factory):
    """A bf16 engine started from `updated_weights`. Session-scoped like the others: shutting down an
    in-process vLLM engine tears down vLLM's process-global distributed state, which every other
    in-process engine of this process still uses."""
    import shutil

    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("zaya_updated") / "ckpt"
    shutil.copytree(serving_checkpoint, path)
    save_file(updated_weights, path / "model.safetensors", metadata={"format": "pt"})
    engine = _engine(path, "bfloat16")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def fp32_reference(serving_checkpoint):
    from zrl.moepp.checkpoint import load_hf_checkpoint

    return load_hf_checkpoint(serving_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def bf16_reference(serving_checkpoint):
    from zrl.moepp.checkpoint import load_hf_checkpoint

    return load_hf_checkpoint(serving_checkpoint, dtype=torch.bfloat16).eval()
