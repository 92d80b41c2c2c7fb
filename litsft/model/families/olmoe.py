"""OLMoE: Llama's pre-norm block with a mixture of experts for the MLP (64 experts, 8 per token, softmax then
top-k, not renormalized), and OLMo 2's RMSNorm on the whole query and key projections.

Sources of the named configs: https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json and
https://huggingface.co/allenai/OLMoE-1B-7B-0924-Instruct/blob/main/config.json.
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.llama import attention_biases
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

OLMOE_BLOCK_VALUES = dict(qk_norm=True, qk_norm_over="all_heads")


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {
        **attention_biases(hf_config),
        **OLMOE_BLOCK_VALUES,
        **routed_experts_from_hf(hf_config, ("num_experts",)),
        "normalize_expert_weights": bool(hf_config.get("norm_topk_prob", False)),
    }


def _hf_from_config(config: Any) -> dict[str, Any]:
    return {
        "attention_bias": config.out_bias,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "intermediate_size": config.expert_intermediate,  # every MLP is routed: this is the experts' width
        "norm_topk_prob": config.normalize_expert_weights,
        "router_aux_loss_coef": config.router_aux_loss_coef,
    }


# 50304 embedding rows, 4096 positions, RoPE theta 1e4, untied; 16 layers of 64 experts (intermediate 1024),
# 8 per token; router_aux_loss_coef 0.01. The Instruct release has the same shapes and config.
OLMOE_VALUES = dict(
    vocab_size=50304,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    eos_token_id=50279,
    num_experts=64,
    experts_per_token=8,
    router_aux_loss_coef=0.01,
    hf_architecture="OlmoeForCausalLM",
    **OLMOE_BLOCK_VALUES,
)
NAMED: dict[str, dict[str, Any]] = {}
for name in ("OLMoE-1B-7B-0924", "OLMoE-1B-7B-0924-Instruct"):
    NAMED.update([published(name, 16, 2048, 16, 16, 1024, **OLMOE_VALUES)])

OLMOE_FAMILY = register_family(
    Family(
        architecture="OlmoeForCausalLM",
        model_type="olmoe",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=ROUTED_EXPERT_KEYS | {"attention_bias", "num_experts", "norm_topk_prob"},
        hf_keys_ignored={
            **DECODER_IGNORED,
            **MOE_IGNORED,
            "clip_qkv": unsupported(
                "litsft does not clamp q, k and v; OLMoE's published models do not", None
            ),
        },
        weights=WeightMap(MOE_WEIGHT_NAMES, experts=MOE_EXPERT_NAMES),
        named_configs=NAMED,
    )
)
