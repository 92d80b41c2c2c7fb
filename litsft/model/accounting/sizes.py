"""The model's sizes read off the model itself: `Transformer(config)` built on the meta device (shapes, no
memory), so that parameter, FLOP, adapter and activation counts (litsft.model.accounting.flops, litsft.training.plan) follow whatever
block a family builds, with no formula written beside the model. The activations a block keeps for the
backward pass are the tensors autograd saves in one block's forward pass, recorded on fake tensors (shapes
and dtypes, no memory, no compute)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from litsft.model.config import NAMED_CONFIGS, Config, format_count
from litsft.model.lora.config import LoRAConfig
from litsft.model.lora.layers import apply_lora
from litsft.model.network.attention import prepare
from litsft.model.network.transformer import RMSNorm, Transformer, rope_cos_sin


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
    expert_weights: int = 0
    """Weights of all routed experts (E x 3 x C x I); 0 for a dense MLP."""
    active_expert_weights: int = 0
    """Expert parameters each token uses: its k experts' (k x 3 x C x I, and their biases where they have them)."""
    active_expert_matmul_weights: int = 0
    """Expert weights each token multiplies by: its k experts' (k x 3 x C x I), without their biases (gpt-oss)."""


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
        experts = sum(layer.active_expert_matmul_weights for layer in self.layers)
        return weights + experts + self.lm_head[0] * self.lm_head[1]

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward pass uses: all but the experts it is not routed to."""
        return self.parameters - sum(
            layer.expert_weights - layer.active_expert_weights for layer in self.layers
        )


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
        experts = getattr(block.mlp, "experts", None)  # litsft.model.network.moe.GroupedExperts
        expert_weights = sum(p.numel() for p in experts.parameters()) if experts is not None else 0
        expert_matmuls = (
            experts.gate_up_proj.numel() + experts.down_proj.numel() if experts is not None else 0
        )
        routed = config.experts_per_token / max(config.num_experts, 1)
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
                expert_weights=expert_weights,
                active_expert_weights=int(expert_weights * routed),
                active_expert_matmul_weights=int(expert_matmuls * routed),
            )
        )
    head = model.lm_head
    return ModelSizes(
        parameters=sum(p.numel() for p in model.parameters()),
        layers=tuple(layers),
        lm_head=(head.in_features, head.out_features),
    )


ACTIVATION_PROBE_TOKENS = 64
"""Tokens of the one-block forward pass whose saved tensors are recorded: fewer than the CPU attention's query
chunk (litsft.model.network.attention.QUERY_CHUNK), so that attention is one fused SDPA call, whose saved tensors (q, k, v,
its output, a logsumexp per head and query) grow with the tokens as a flash kernel's do."""


def block_saved_bytes_per_token(config: Config, dtype: torch.dtype, lora: LoRAConfig | None = None) -> int:
    """Bytes the largest block saves for its backward pass per token, running in `dtype`, with `lora`'s
    adapters (a frozen projection keeps no input, autograd saves only what a gradient needs).

    Recorded with `saved_tensors_hooks` in a forward pass of that block on fake tensors, counting each saved
    storage once and leaving out what the block does not own: parameters (and views of them) and the tensors
    every block shares (RoPE's cos and sin). Assumes a fused attention kernel (no (T, T) scores kept) without
    a window and no attention dropout. LoRA's dropout runs as in training: each adapter keeps its own dropped
    input and the mask, here in `dtype` (the CPU's dropout; a GPU's mask takes one byte per element)."""
    lora_json = json.dumps(asdict(lora), sort_keys=True) if lora is not None else ""
    return _saved_bytes_of(
        json.dumps(asdict(config), sort_keys=True), str(dtype).removeprefix("torch."), lora_json
    )


@lru_cache(maxsize=64)
def _saved_bytes_of(config_json: str, dtype_name: str, lora_json: str) -> int:
    # A fused kernel keeps the same tensors whether it soft-caps the scores or not (flex's score_mod).
    config = replace(Config(**json.loads(config_json)), softcap_attention=None)
    dtype = getattr(torch, dtype_name)
    largest = max(range(config.num_layers), key=lambda i: model_sizes(config).layers[i].parameters)
    T = ACTIVATION_PROBE_TOKENS
    default_dtype = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # parameters built in `dtype`: fake parameters cannot be cast
        try:
            model = Transformer(config).eval()  # no attention dropout
        finally:
            torch.set_default_dtype(default_dtype)
        if lora_json:  # adapters in training mode: their dropout keeps masks
            apply_lora(model, LoRAConfig(**json.loads(lora_json)))
        block = model.blocks[largest]
        x = torch.empty(1, T, config.hidden_size, dtype=dtype, requires_grad=True)  # (B, T, C)
        cos, sin = rope_cos_sin(config, torch.arange(T)[None], dtype)
        not_owned = {tensor.untyped_storage()._cdata for tensor in (*block.parameters(), cos, sin)}
        saved: dict[int, int] = {}

        def record(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in not_owned:
                saved[storage._cdata] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
            block(x, cos, sin, prepare("segmented", (1, T), x.device))
    return -(-sum(saved.values()) // T)


def num_parameters(config: Config) -> int:
    """Parameter count of `config`'s model, tied embeddings counted once."""
    return model_sizes(config).parameters


def list_models() -> None:
    """Print the named model configs with their parameter counts."""
    width = max(len(name) for name in NAMED_CONFIGS)
    for name, config in NAMED_CONFIGS.items():
        print(f"{name:<{width}}  {format_count(num_parameters(config)):>6}  {config.hf_architecture}")
