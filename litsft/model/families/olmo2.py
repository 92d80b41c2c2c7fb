"""OLMo 2: Llama's layers with the norms moved after attention and after the MLP (no norm before either), and
RMSNorm on the whole query and key projections (all heads at once) before they are split into heads.

Sources of the named configs: https://huggingface.co/allenai/OLMo-2-0425-1B/blob/main/config.json,
https://huggingface.co/allenai/OLMo-2-1124-7B/blob/main/config.json and
https://huggingface.co/allenai/OLMo-2-1124-13B/blob/main/config.json.
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.llama import attention_biases
from litsft.model.families.spec import (
    DECODER_IGNORED,
    LLAMA_WEIGHT_NAMES,
    Family,
    WeightMap,
    published,
    register_family,
)

OLMO2_WEIGHTS = WeightMap(
    {
        **{
            litsft: hf
            for litsft, hf in LLAMA_WEIGHT_NAMES.items()
            if litsft not in ("blocks.{i}.attn_norm.weight", "blocks.{i}.mlp_norm.weight")
        },
        "blocks.{i}.attn_post_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.mlp_post_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    }
)
OLMO2_BLOCK_VALUES = dict(
    pre_norms=False, post_attention_norm=True, post_mlp_norm=True, qk_norm=True, qk_norm_over="all_heads"
)


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {**attention_biases(hf_config), **OLMO2_BLOCK_VALUES}


def _hf_from_config(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.out_bias}


# 100352 embedding rows (the tokenizer's 100278 tokens, padded), 4096 positions, RoPE theta 5e5, untied,
# multi-head attention (as many kv heads as heads).
OLMO2_VALUES = dict(
    vocab_size=100352,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hf_architecture="Olmo2ForCausalLM",
    **OLMO2_BLOCK_VALUES,
)
NAMED: dict[str, dict[str, Any]] = {}
for name, *shape in (
    ("OLMo-2-0425-1B", 16, 2048, 16, 16, 8192),
    ("OLMo-2-1124-7B", 32, 4096, 32, 32, 11008),
    ("OLMo-2-1124-13B", 40, 5120, 40, 40, 13824),
):
    NAMED.update([published(name, *shape, **OLMO2_VALUES)])

OLMO2_FAMILY = register_family(
    Family(
        architecture="Olmo2ForCausalLM",
        model_type="olmo2",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=frozenset({"attention_bias"}),
        hf_keys_ignored=DECODER_IGNORED,
        weights=OLMO2_WEIGHTS,
        named_configs=NAMED,
    )
)
