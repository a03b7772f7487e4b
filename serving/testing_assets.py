"""Tiny ZAYA checkpoints with non-trivial behaviour, for the serving tests and benchmarks.

`zrl.assets.build_tiny_model` writes a freshly initialised model: every router sends all tokens the
same way and zero key temperatures make attention uniform, so a routing or attention bug could pass
unnoticed. `build_serving_checkpoint` rescales those tensors with a seeded generator so that several
experts and the skip class are chosen, attention is peaked and logits are far from uniform.
head_dim is 32 because vLLM's CPU attention backend supports head sizes from 32 up.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SERVING_TINY_OVERRIDES = dict(head_dim=32)


def build_serving_checkpoint(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write tokenizer + a tiny `zaya` checkpoint with randomised routers, temperatures and embeddings."""
    from zrl.assets import build_tiny_model

    path = build_tiny_model(out_dir, seed=seed, **{**SERVING_TINY_OVERRIDES, **overrides})
    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed + 1)

    def normal(shape, std):
        return torch.randn(shape, generator=generator) * std

    for name, tensor in list(tensors.items()):
        if name.endswith(("router_mlp.fc1.weight", "router_mlp.fc2.weight", "router_mlp.out_proj.weight")):
            tensors[name] = normal(tensor.shape, 2.0 / tensor.shape[1] ** 0.5)
        elif name.endswith("mlp.gate.balancing_biases"):
            tensors[name] = normal(tensor.shape, 0.02)  # the skip class is calibrated below
        elif name.endswith("qk_norm.temp"):
            tensors[name] = 1.0 + normal(tensor.shape, 0.5).abs()
        elif name == "model.embed_tokens.weight":
            tensors[name] = normal(tensor.shape, 0.1)
        elif name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            tensors[name] = normal(tensor.shape, 0.5 / tensor.shape[-1] ** 0.5)
    _calibrate_skip_biases(path, tensors, generator)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@torch.no_grad()
def _calibrate_skip_biases(path: Path, tensors: dict[str, torch.Tensor], generator: torch.Generator,
                           skip_fraction: float = 0.2) -> None:
    """Set each layer's skip-class balancing bias so that about `skip_fraction` of random tokens skip.

    Layer by layer (a layer's choices change the next layer's inputs), on zrl.moepp's model: the bias
    is the quantile of the margin by which the skip class loses (best biased expert minus skip prob).
    """
    from zrl.moepp.config import MoEPPConfig
    from zrl.moepp.family import MoEPPFamily
    from zrl.moepp.model import MoEPPForCausalLM

    model = MoEPPForCausalLM(MoEPPConfig.from_pretrained_dir(path)).eval()
    model.load_state_dict({MoEPPFamily.hf_names.param_name(k): v for k, v in tensors.items()})
    tokens = torch.randint(10, model.config.vocab_size, (8, 64), generator=generator)
    for layer_idx, layer in enumerate(model.layers):
        captured = []
        # The router fuses its MLP (kernels/router): recompute the logits from its post-EDA latent.
        hook = layer.mlp.gate.register_forward_hook(lambda m, i, out: captured.append(m.router_mlp(out.state)))
        model(tokens)
        hook.remove()
        probs = torch.softmax(captured[0].float(), dim=-1)  # [T, E + 1]
        biases = layer.mlp.gate.balancing_biases
        margin = (probs[:, :-1] + biases[:-1]).max(dim=-1).values - probs[:, -1]
        biases[-1] = torch.quantile(margin, skip_fraction)
        tensors[f"model.layers.{layer_idx}.mlp.gate.balancing_biases"] = biases.clone()


def perturbed_state_dict(path: str | Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (HF keys) with seeded Gaussian noise added to every floating tensor
    except the balancing biases: a stand-in for "the trainer's next weights"."""
    tensors = load_file(Path(path) / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not name.endswith("balancing_biases"):
            noise = torch.randn(tensor.shape, generator=generator) * scale * tensor.float().std().clamp_min(1e-3)
            tensor = (tensor.float() + noise).to(tensor.dtype)
        out[name] = tensor
    return out
