"""Granite 3 (transformers' GraniteForCausalLM): Llama's block with four multipliers from its μP training. The
embeddings are multiplied by `embedding_multiplier`, each block's attention and MLP outputs by
`residual_multiplier` before they join the residual stream, attention scores by `attention_multiplier` (in place
of head_dim ** -0.5), and the output logits are divided by `logits_scaling`.

Source of the named config: https://huggingface.co/ibm-granite/granite-3.1-2b-instruct/blob/main/config.json
(40 layers of 2048, 32 heads, 8 kv heads, MLP 8192, 49155 tokens, RoPE theta 5e6, 131072 positions, tied
embeddings, multipliers 12.0 / 0.22 / 0.015625 / 8.0, <|end_of_text|> (0) as bos and eos). The multipliers:
https://github.com/huggingface/transformers/blob/main/src/transformers/models/granite/modeling_granite.py.
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.llama import TINY_VALUES, attention_biases
from litsft.model.families.spec import DECODER_IGNORED, Family, published, register_family

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
"""Granite's config.json keys, each a `Config` field of the same name."""


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    # transformers' GraniteConfig defaults each multiplier to 1.0: attention then scales scores by 1, not by
    # head_dim ** -0.5.
    return {**attention_biases(hf_config), **{key: float(hf_config.get(key, 1.0)) for key in MULTIPLIERS}}


def _hf_from_config(config: Any) -> dict[str, Any]:
    multipliers = {key: getattr(config, key) for key in MULTIPLIERS}
    if multipliers["attention_multiplier"] is None:  # a Config built without one: the kernels' default
        multipliers["attention_multiplier"] = config.head_dim**-0.5
    return {"attention_bias": config.out_bias, "mlp_bias": False, **multipliers}


GRANITE3_VALUES = dict(
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.015625,
    logits_scaling=8.0,
    hf_architecture="GraniteForCausalLM",
)
NAMED: dict[str, dict[str, Any]] = {}
NAMED.update(
    [
        published("tiny-granite", 2, 64, 4, 2, 176, **TINY_VALUES, **GRANITE3_VALUES),
        published(
            "granite-3.1-2b-instruct",
            40,
            2048,
            32,
            8,
            8192,
            vocab_size=49155,
            max_position_embeddings=131072,
            rope_theta=5000000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
            **GRANITE3_VALUES,
        ),
    ]
)

GRANITE_FAMILY = register_family(
    Family(
        architecture="GraniteForCausalLM",
        model_type="granite",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=frozenset({"attention_bias", *MULTIPLIERS}),
        hf_keys_ignored=DECODER_IGNORED,
        named_configs=NAMED,
    )
)
