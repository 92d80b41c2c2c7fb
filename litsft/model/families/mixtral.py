"""Mixtral: Mistral's block with a mixture of experts for the MLP (8 experts, 2 per token: softmax then top-k,
always renormalized, which is the softmax of the top-k logits), stored in the hub as
`block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2` (down).

Sources of the named configs: https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json,
https://huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/main/config.json and
https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json.
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.mistral import MISTRAL_FAMILY
from litsft.model.families.spec import (
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

MIXTRAL_WEIGHTS = WeightMap(
    {
        **{litsft: hf for litsft, hf in MOE_WEIGHT_NAMES.items() if ".mlp." not in litsft},
        "blocks.{i}.mlp.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    },
    experts={
        "blocks.{i}.mlp.experts.gate_up_proj": (
            "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
            "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        ),
        "blocks.{i}.mlp.experts.down_proj": ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",),
    },
)


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {
        **MISTRAL_FAMILY.config_from_hf(hf_config),
        **routed_experts_from_hf(hf_config, ("num_local_experts",)),
        "normalize_expert_weights": True,
    }


def _hf_from_config(config: Any) -> dict[str, Any]:
    return {
        **MISTRAL_FAMILY.hf_from_config(config),
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "intermediate_size": config.expert_intermediate,  # every MLP is routed: this is the experts' width
        "router_aux_loss_coef": config.router_aux_loss_coef,
    }


# 32000 tokens, RoPE theta 1e6, no sliding window, 8 experts, 2 per token. 8x7B: 32768 positions,
# router_aux_loss_coef 0.02; 8x22B: 65536 positions, 0.001.
MIXTRAL_VALUES = dict(
    vocab_size=32000,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    num_experts=8,
    experts_per_token=2,
    normalize_expert_weights=True,
    hf_architecture="MixtralForCausalLM",
)
NAMED: dict[str, dict[str, Any]] = {}
for name, *shape, positions, coef in (
    ("Mixtral-8x7B-v0.1", 32, 4096, 32, 8, 14336, 32768, 0.02),
    ("Mixtral-8x7B-Instruct-v0.1", 32, 4096, 32, 8, 14336, 32768, 0.02),
    ("Mixtral-8x22B-v0.1", 56, 6144, 48, 8, 16384, 65536, 0.001),
):
    NAMED.update(
        [
            published(
                name, *shape, **MIXTRAL_VALUES, max_position_embeddings=positions, router_aux_loss_coef=coef
            )
        ]
    )

MIXTRAL_FAMILY = register_family(
    Family(
        architecture="MixtralForCausalLM",
        model_type="mixtral",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=MISTRAL_FAMILY.hf_keys_read | ROUTED_EXPERT_KEYS | {"num_local_experts"},
        hf_keys_ignored={
            **MISTRAL_FAMILY.hf_keys_ignored,
            **MOE_IGNORED,
            "router_jitter_noise": unsupported(
                "litsft does not scale the router's input by random noise; the published models train without",
                0.0,
            ),
        },
        weights=MIXTRAL_WEIGHTS,
        named_configs=NAMED,
    )
)
