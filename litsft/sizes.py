"""The model's sizes read off the model itself: `Transformer(config)` built on the meta device (shapes, no
memory), so that parameter, FLOP, adapter and activation counts (litsft.flops, litsft.plan) follow whatever
block a family builds, with no formula written beside the model."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
from torch import nn

from litsft.config import NAMED_CONFIGS, Config, format_count
from litsft.model import RMSNorm, Transformer


@dataclass(frozen=True)
class LayerSizes:
    """One transformer block as built."""

    parameters: int
    linear: dict[str, tuple[int, int]]
    """(in_features, out_features) of each linear layer, by LoRA target name (q, k, v, o, gate, up, down)."""
    attention_width: int
    """Query heads x head dim: the width of the scores' and the weighted sum's matmuls."""
    kv_width: int
    """kv heads x head dim."""
    window: int | None
    """The layer's sliding window, or None for full causal attention."""
    qk_norm: bool
    pre_norms: bool
    """Whether RMSNorm runs before attention and the MLP (not in OLMo 2)."""
    post_norms: int
    """RMSNorms on the attention and MLP outputs, before the residual add (Gemma: 2, OLMo 2: 2)."""


@dataclass(frozen=True)
class ModelSizes:
    parameters: int
    """Every parameter, a tied output head counted once (as `sum(p.numel())` counts it)."""
    layers: tuple[LayerSizes, ...]
    lm_head: tuple[int, int]
    """(in_features, out_features) of the output head, which runs even when tied to the embedding."""

    @property
    def root_parameters(self) -> int:
        """Parameters outside the blocks: embeddings (and an untied output head), the final norm."""
        return self.parameters - sum(layer.parameters for layer in self.layers)

    @property
    def matmul_weights(self) -> int:
        """Weights every token multiplies by: each block's linear layers and the output head."""
        weights = sum(fan_in * fan_out for layer in self.layers for fan_in, fan_out in layer.linear.values())
        return weights + self.lm_head[0] * self.lm_head[1]


def model_sizes(config: Config) -> ModelSizes:
    """The sizes of `config`'s model, read from the model built on the meta device."""
    return _sizes_of(json.dumps(asdict(config), sort_keys=True))


@lru_cache(maxsize=64)
def _sizes_of(config_json: str) -> ModelSizes:
    config = Config(**json.loads(config_json))
    with torch.device("meta"):
        model = Transformer(config)
    layers = []
    for index, block in enumerate(model.blocks):
        linear = {
            name.rpartition(".")[2].removesuffix("_proj"): (module.in_features, module.out_features)
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear)
        }
        layers.append(
            LayerSizes(
                parameters=sum(p.numel() for p in block.parameters()),
                linear=linear,
                attention_width=linear["q"][1],
                kv_width=linear["k"][1],
                window=config.attention_window(index),
                qk_norm=any(name.endswith(("q_norm", "k_norm")) for name, _ in block.named_modules()),
                pre_norms=isinstance(getattr(block, "attn_norm", None), RMSNorm),
                post_norms=sum(
                    isinstance(getattr(block, name, None), RMSNorm)
                    for name in ("attn_post_norm", "mlp_post_norm")
                ),
            )
        )
    head = model.lm_head
    return ModelSizes(
        parameters=sum(p.numel() for p in model.parameters()),
        layers=tuple(layers),
        lm_head=(head.in_features, head.out_features),
    )


def num_parameters(config: Config) -> int:
    """Parameter count of `config`'s model, tied embeddings counted once."""
    return model_sizes(config).parameters


def list_models() -> None:
    """Print the named model configs with their parameter counts."""
    width = max(len(name) for name in NAMED_CONFIGS)
    for name, config in NAMED_CONFIGS.items():
        print(f"{name:<{width}}  {format_count(num_parameters(config)):>6}  {config.hf_architecture}")
