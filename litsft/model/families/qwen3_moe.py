"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, no bias) with a mixture of experts for every MLP (128
experts of `moe_intermediate_size`, 8 per token, softmax then top-k, renormalized when `norm_topk_prob`).

Sources of the named configs: https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json and
https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json.
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.llama import attention_biases
from litsft.model.families.qwen2 import WINDOW_KEYS, sliding_layers_from_hf, sliding_layers_to_hf
from litsft.model.families.qwen3 import QWEN3_VALUES
from litsft.model.families.spec import (
    DECODER_IGNORED,
    MOE_EXPERT_NAMES,
    MOE_IGNORED,
    MOE_WEIGHT_NAMES,
    ROUTED_EXPERT_KEYS,
    Family,
    WeightMap,
    published,
    register_family,
    routed_experts_from_hf,
    unsupported,
)

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
"""The hub's config.json files say num_experts; transformers 5 writes num_local_experts."""


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {
        **attention_biases(hf_config),
        **sliding_layers_from_hf(hf_config),
        **routed_experts_from_hf(hf_config, EXPERT_COUNT_KEYS),
        "qk_norm": True,
        "expert_intermediate_size": int(hf_config["moe_intermediate_size"]),
        "normalize_expert_weights": bool(hf_config.get("norm_topk_prob", False)),
    }


def _hf_from_config(config: Any) -> dict[str, Any]:
    return {
        **sliding_layers_to_hf(config),
        "attention_bias": config.out_bias,
        "moe_intermediate_size": config.expert_intermediate,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "norm_topk_prob": config.normalize_expert_weights,
        "router_aux_loss_coef": config.router_aux_loss_coef,
    }


EVERY_LAYER_SPARSE = "litsft routes every layer's MLP, as the published models do"
# Qwen3's vocabulary, head_dim 128, theta 1e6 and 40960 positions; 128 experts, 8 per token, renormalized,
# router_aux_loss_coef 0.001; `intermediate_size` is that of the dense layers the published models do not have.
QWEN3_MOE_VALUES = dict(
    QWEN3_VALUES,
    tie_word_embeddings=False,
    num_experts=128,
    experts_per_token=8,
    normalize_expert_weights=True,
    router_aux_loss_coef=0.001,
    hf_architecture="Qwen3MoeForCausalLM",
)
NAMED: dict[str, dict[str, Any]] = {}
for name, *shape, expert_intermediate in (
    ("Qwen3-30B-A3B", 48, 2048, 32, 4, 6144, 768),
    ("Qwen3-235B-A22B", 94, 4096, 64, 4, 12288, 1536),
):
    NAMED.update([published(name, *shape, **QWEN3_MOE_VALUES, expert_intermediate_size=expert_intermediate)])

QWEN3_MOE_FAMILY = register_family(
    Family(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=WINDOW_KEYS
        | ROUTED_EXPERT_KEYS
        | {"attention_bias", "moe_intermediate_size", "norm_topk_prob", *EXPERT_COUNT_KEYS},
        hf_keys_ignored={
            **DECODER_IGNORED,
            **MOE_IGNORED,
            # Dense MLPs between the sparse ones: none in the published models.
            "decoder_sparse_step": unsupported(EVERY_LAYER_SPARSE, 1),
            "mlp_only_layers": unsupported(EVERY_LAYER_SPARSE, []),
        },
        weights=WeightMap(MOE_WEIGHT_NAMES, experts=MOE_EXPERT_NAMES),
        named_configs=NAMED,
    )
)
