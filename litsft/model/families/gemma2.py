"""Gemma 2: Llama's decoder with Gemma's numerics. RMSNorm scales by (1 + weight), norms sit on both sides of
attention and of the MLP ("sandwich"), the embeddings are scaled by sqrt(hidden_size), the MLP is GeGLU
(tanh GELU), attention scores are scaled by query_pre_attn_scalar ** -0.5 and soft-capped, the output logits
soft-capped too, and layers alternate a 4096-token sliding window (even layers) with full attention.

Sources of the named configs: each model's config.json,
https://huggingface.co/google/gemma-2-2b/blob/main/config.json,
https://huggingface.co/google/gemma-2-2b-it/blob/main/config.json,
https://huggingface.co/google/gemma-2-9b/blob/main/config.json,
https://huggingface.co/google/gemma-2-27b/blob/main/config.json; the keys a config.json leaves out take
transformers' Gemma2Config defaults,
https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma2/configuration_gemma2.py.
"""

from __future__ import annotations

from typing import Any

from litsft.errors import LitsftError
from litsft.model.families.llama import TINY_VALUES, attention_biases
from litsft.model.families.spec import (
    DECODER_IGNORED,
    LLAMA_WEIGHT_NAMES,
    Family,
    IgnoredKey,
    WeightMap,
    published,
    register_family,
    unsupported,
)

# Gemma's norms: `post_attention_layernorm` is the norm *after* attention (Llama's name for the norm before
# the MLP), `pre_feedforward_layernorm` the one before the MLP.
GEMMA_WEIGHTS = WeightMap(
    {
        **LLAMA_WEIGHT_NAMES,
        "blocks.{i}.attn_post_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.mlp_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blocks.{i}.mlp_post_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    }
)
GEMMA_ACTIVATION = "gelu_pytorch_tanh"
GEMMA_BLOCK_VALUES = dict(
    norm_unit_offset=True,
    post_attention_norm=True,
    post_mlp_norm=True,
    scale_embeddings=True,
    mlp_activation="gelu_tanh",
)
"""The `Config` fields every Gemma 2 and Gemma 3 model sets."""
GEMMA_KEYS = frozenset(
    {
        "attention_bias",
        "hidden_activation",
        "hidden_act",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
        "sliding_window_pattern",
        "_sliding_window_pattern",
    }
)
"""The config.json keys `gemma_from_hf` reads (`_sliding_window_pattern`: transformers 5's spelling)."""
GEMMA_IGNORED: dict[str, IgnoredKey] = {
    **{key: ignored for key, ignored in DECODER_IGNORED.items() if key not in GEMMA_KEYS},
    "use_bidirectional_attention": unsupported(
        "attention both ways, for embedding models; litsft trains causal language models only", None, False
    ),
}


def gemma_from_hf(hf_config: dict[str, Any], defaults: dict[str, Any], sliding_every: int) -> dict[str, Any]:
    """The `Config` fields of a Gemma 2 or 3 config.json; a missing key takes transformers' default from
    `defaults` (config.json key -> value). Without `layer_types`, layer i slides unless (i + 1) is a multiple
    of `sliding_every` (transformers' sliding_window_pattern: 2 for Gemma 2, 6 for Gemma 3)."""
    # transformers reads hidden_activation; config.json files from before it was named say hidden_act.
    named = hf_config.get("hidden_activation"), hf_config.get("hidden_act")
    activation = next((name for name in named if name), GEMMA_ACTIVATION)
    if activation != GEMMA_ACTIVATION:
        raise LitsftError(
            f"hidden_activation={activation!r} is not supported; litsft's Gemma MLP is GeGLU ({GEMMA_ACTIVATION})"
        )

    def get(key: str) -> Any:
        return hf_config.get(key, defaults.get(key))

    num_layers = hf_config["num_hidden_layers"]
    every = (
        hf_config.get("sliding_window_pattern") or hf_config.get("_sliding_window_pattern") or sliding_every
    )
    layer_types = hf_config.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)
    ]
    return dict(
        **attention_biases(hf_config),
        **GEMMA_BLOCK_VALUES,
        head_dim=get("head_dim"),
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        query_pre_attn_scalar=get("query_pre_attn_scalar"),
        softcap_attention=get("attn_logit_softcapping"),
        softcap_final=get("final_logit_softcapping"),
        sliding_window=get("sliding_window"),
        layer_types=list(layer_types),
    )


def gemma_to_hf(config: Any) -> dict[str, Any]:
    """The config.json keys of a Gemma 2 or 3 model beyond the shared ones."""
    if config.sliding_window is None:
        layer_types = ["full_attention"] * config.num_layers
    else:
        layer_types = config.layer_types or ["sliding_attention"] * config.num_layers
    return {
        "attention_bias": config.out_bias,
        "hidden_act": GEMMA_ACTIVATION,
        "hidden_activation": GEMMA_ACTIVATION,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "attn_logit_softcapping": config.softcap_attention,
        "final_logit_softcapping": config.softcap_final,
        "sliding_window": config.sliding_window,
        "layer_types": list(layer_types),
    }


GEMMA2_DEFAULTS = {
    "head_dim": 256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "sliding_window": 4096,
}
"""transformers' Gemma2Config defaults for the keys Gemma 2 reads."""


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return gemma_from_hf(hf_config, GEMMA2_DEFAULTS, sliding_every=2)


# 256000 tokens, RoPE theta 1e4, 8192 positions, a 4096-token window on even layers, caps 50 (attention) and
# 30 (logits), tied embeddings; <bos> is 2, <eos> 1 (the -it release also stops at <end_of_turn>, 107).
GEMMA2_VALUES = dict(
    vocab_size=256000,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    sliding_window=4096,
    softcap_attention=50.0,
    softcap_final=30.0,
    bos_token_id=2,
    eos_token_id=1,
    hf_architecture="Gemma2ForCausalLM",
    **GEMMA_BLOCK_VALUES,
)
NAMED: dict[str, dict[str, Any]] = {}
# A tiny Gemma 2 for tests: every feature above, a window that 64-token rows reach past.
TINY_GEMMA2_VALUES = dict(
    GEMMA2_VALUES,
    **TINY_VALUES,
    sliding_window=16,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention"],
)
NAMED.update([published("tiny-gemma2", 2, 64, 4, 2, 176, **TINY_GEMMA2_VALUES)])
for size, *shape, head_dim, scalar in (
    ("2b", 26, 2304, 8, 4, 9216, 256, 256),
    ("9b", 42, 3584, 16, 8, 14336, 256, 256),
    ("27b", 46, 4608, 32, 16, 36864, 128, 144),
):
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape[0])]
    own = dict(head_dim=head_dim, query_pre_attn_scalar=scalar, layer_types=layer_types)
    name, base = published(f"gemma-2-{size}", *shape, **GEMMA2_VALUES, **own)
    NAMED[name] = base
NAMED["gemma-2-2b"]["torch_dtype"] = "float32"
NAMED["gemma-2-2b-it"] = {
    **NAMED["gemma-2-2b"],
    "name": "gemma-2-2b-it",
    "eos_token_id": [1, 107],
    "torch_dtype": "bfloat16",
}

GEMMA2_FAMILY = register_family(
    Family(
        architecture="Gemma2ForCausalLM",
        model_type="gemma2",
        config_from_hf=_config_from_hf,
        hf_from_config=gemma_to_hf,
        hf_keys_read=GEMMA_KEYS,
        hf_keys_ignored=GEMMA_IGNORED,
        weights=GEMMA_WEIGHTS,
        named_configs=NAMED,
    )
)
