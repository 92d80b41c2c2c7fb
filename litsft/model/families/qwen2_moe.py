"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (a bias on q, k and v, the same sliding-window keys)
with a mixture of experts for the MLP of every `decoder_sparse_step`-th layer not in `mlp_only_layers` (the others
dense, of `intermediate_size`): `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` per token
(softmax then top-k, renormalized when `norm_topk_prob`), and beside them a shared expert, a SwiGLU MLP of
`shared_expert_intermediate_size` that every token runs, scaled by sigmoid(`shared_expert_gate`(x)) and added to
the routed experts' output (transformers' Qwen2MoeSparseMoeBlock).

Sources of the named configs: https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json and
https://huggingface.co/Qwen/Qwen2-57B-A14B/blob/main/config.json.
"""

from __future__ import annotations

from typing import Any

from litsft.errors import LitsftError
from litsft.model.families.qwen2 import (
    DEFAULT_MAX_WINDOW_LAYERS,
    WINDOW_KEYS,
    sliding_layers_from_hf,
    sliding_layers_to_hf,
)
from litsft.model.families.spec import (
    DECODER_IGNORED,
    LLAMA_WEIGHT_NAMES,
    MOE_EXPERT_NAMES,
    MOE_IGNORED,
    ROUTED_EXPERT_KEYS,
    Family,
    WeightMap,
    published,
    register_family,
    routed_experts_from_hf,
)

LAYOUT_KEYS = frozenset({"decoder_sparse_step", "mlp_only_layers"})
"""The config.json keys that say which layers route their MLP."""


def _default_layer_types(hf_config: dict[str, Any]) -> list[str]:
    """Each layer's attention when config.json has no `layer_types`: Qwen2-MoE's own rule, not Qwen2's (the even
    layers below max_window_layers slide; transformers' Qwen2MoeConfig.__post_init__)."""
    below = hf_config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
    return [
        "sliding_attention" if (i + 1) % 2 and i < below else "full_attention"
        for i in range(hf_config["num_hidden_layers"])
    ]


def _sparse_layers_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    step = hf_config.get("decoder_sparse_step", 1)
    dense = hf_config.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise LitsftError(
            f"config.json's decoder_sparse_step is {step!r}, but every how many layers the MLP is a mixture of "
            "experts is a whole number from 1; restore the original config.json"
        )
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise LitsftError(
            f"config.json's mlp_only_layers is {dense!r}, but it lists the indices of the layers with a dense MLP; "
            "restore the original config.json"
        )
    return {"sparse_step": step, "dense_layers": sorted(set(dense))}


def _shared_expert_from_hf(hf_config: dict[str, Any]) -> int:
    size = hf_config["shared_expert_intermediate_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        # transformers still builds the shared expert's gate and empty projections, which litsft has no place for
        raise LitsftError(
            f"config.json's shared_expert_intermediate_size is {size!r}, but litsft builds Qwen2-MoE's shared "
            "expert at least 1 wide, as the published models have it; restore the original config.json"
        )
    return size


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    window = sliding_layers_from_hf(hf_config)
    if window["sliding_window"] is not None and not hf_config.get("layer_types"):
        window["layer_types"] = _default_layer_types(hf_config)
    qkv_bias = hf_config.get("qkv_bias")
    return {
        **window,
        **routed_experts_from_hf(hf_config, ("num_experts",)),
        **_sparse_layers_from_hf(hf_config),
        "qkv_bias": True if qkv_bias is None else bool(qkv_bias),  # transformers 5's key; older files lack it
        "expert_intermediate_size": int(hf_config["moe_intermediate_size"]),
        "shared_expert_intermediate_size": _shared_expert_from_hf(hf_config),
        "normalize_expert_weights": bool(hf_config.get("norm_topk_prob", False)),
    }


def _hf_from_config(config: Any) -> dict[str, Any]:
    hf = sliding_layers_to_hf(config)
    if config.sliding_window is not None:  # max_window_layers alone reads back by another rule here
        hf["layer_types"] = config.layer_types or ["sliding_attention"] * config.num_layers
    return {
        **hf,
        "qkv_bias": config.qkv_bias,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "moe_intermediate_size": config.expert_intermediate,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "norm_topk_prob": config.normalize_expert_weights,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "decoder_sparse_step": config.sparse_step,
        "mlp_only_layers": list(config.dense_layers),
    }


# Qwen2's decoder layout (the dense layers' MLP under its own names), the router as `mlp.gate`, the experts as
# the other MoE families store them, and the shared expert and its gate under transformers' names.
QWEN2_MOE_WEIGHT_NAMES: dict[str, str] = {
    **LLAMA_WEIGHT_NAMES,
    "blocks.{i}.mlp.router.weight": "model.layers.{i}.mlp.gate.weight",
    **{
        f"blocks.{{i}}.mlp.shared_expert.{projection}.weight": (
            f"model.layers.{{i}}.mlp.shared_expert.{projection}.weight"
        )
        for projection in ("gate_proj", "up_proj", "down_proj")
    },
    "blocks.{i}.mlp.shared_expert_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}

# Qwen's vocabulary, bias on q/k/v, theta 1e6, untied; 60 or 64 experts, not renormalized, every layer routed,
# router_aux_loss_coef 0.001; `intermediate_size` is that of the dense layers the published models do not have.
QWEN2_MOE_VALUES = dict(
    vocab_size=151936,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    tie_word_embeddings=False,
    normalize_expert_weights=False,
    router_aux_loss_coef=0.001,
    bos_token_id=151643,
    eos_token_id=151643,
    hf_architecture="Qwen2MoeForCausalLM",
)
NAMED: dict[str, dict[str, Any]] = {}
for name, *shape, context, experts, per_token, expert_intermediate, shared in (
    ("Qwen1.5-MoE-A2.7B", 24, 2048, 16, 16, 5632, 32768, 60, 4, 1408, 5632),
    ("Qwen2-57B-A14B", 28, 3584, 28, 4, 18944, 131072, 64, 8, 2560, 20480),
):
    NAMED.update(
        [
            published(
                name,
                *shape,
                **QWEN2_MOE_VALUES,
                max_position_embeddings=context,
                num_experts=experts,
                experts_per_token=per_token,
                expert_intermediate_size=expert_intermediate,
                shared_expert_intermediate_size=shared,
            )
        ]
    )
# A model for trying the family in seconds: 4 experts of 2 per token, a shared expert, every other layer dense.
TINY_QWEN2_MOE_VALUES = dict(
    QWEN2_MOE_VALUES,
    vocab_size=512,
    max_position_embeddings=512,
    num_experts=4,
    experts_per_token=2,
    expert_intermediate_size=48,
    shared_expert_intermediate_size=96,
    sparse_step=2,
    torch_dtype="float32",
)
NAMED.update([published("tiny-qwen2-moe", 2, 64, 4, 2, 176, **TINY_QWEN2_MOE_VALUES)])

QWEN2_MOE_FAMILY = register_family(
    Family(
        architecture="Qwen2MoeForCausalLM",
        model_type="qwen2_moe",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=WINDOW_KEYS
        | ROUTED_EXPERT_KEYS
        | LAYOUT_KEYS
        | {
            "num_experts",
            "qkv_bias",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
        },
        hf_keys_ignored={**DECODER_IGNORED, **MOE_IGNORED},
        weights=WeightMap(
            QWEN2_MOE_WEIGHT_NAMES,
            experts=MOE_EXPERT_NAMES,
            ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
        ),
        named_configs=NAMED,
    )
)
