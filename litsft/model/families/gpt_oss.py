"""gpt-oss: a mixture of experts on every layer with biases everywhere (q/k/v/o, the router, each expert's two
projections), a learned attention sink per head (a logit that joins each softmax's denominator), layers that
alternate a 128-token sliding window (even layers) with full attention, YaRN RoPE (32 x 4096 positions), and
experts with a clamped SwiGLU; the router takes the top 4 logits and a softmax over them.

The hub stores the experts as MXFP4 (`*_blocks`, `*_scales`: litsft.huggingface.mxfp4 dequantizes them on
conversion) and transformers holds them as `gate_up_proj` (E, C, 2I) with gate and up interleaved along the
last dim (`gate_up_proj[..., ::2]` is the gate) and `down_proj` (E, I, C): `EXPERT_LAYOUTS` turns them into
litsft's (E, 2I, C) gate-then-up and (E, C, I), and back. An export is bf16 without quantization_config.

Sources of the named configs: https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json and
https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json; the keys a config.json leaves out take
transformers' GptOssConfig defaults,
https://github.com/huggingface/transformers/blob/main/src/transformers/models/gpt_oss/configuration_gpt_oss.py.
"""

from __future__ import annotations

from typing import Any

from litsft.errors import LitsftError
from litsft.model.families.llama import TINY_VALUES, attention_biases
from litsft.model.families.spec import (
    DECODER_IGNORED,
    LLAMA_WEIGHT_NAMES,
    MOE_IGNORED,
    ROUTED_EXPERT_KEYS,
    Family,
    Layout,
    WeightMap,
    harmless,
    published,
    register_family,
    routed_experts_from_hf,
)

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")
"""transformers' GptOssConfig says num_local_experts (num_experts is its alias)."""
QUANTIZATION_METHOD = "mxfp4"


def _gate_up_to_litsft(hf: Any) -> Any:
    """(E, C, 2I), gate and up interleaved along the last dim -> (E, 2I, C), each expert's gate rows then up."""
    E, C, I2 = hf.shape
    return hf.reshape(E, C, I2 // 2, 2).permute(0, 3, 2, 1).reshape(E, I2, C).contiguous()


def _gate_up_to_hf(litsft: Any) -> Any:
    E, I2, C = litsft.shape
    return litsft.reshape(E, 2, I2 // 2, C).permute(0, 3, 2, 1).reshape(E, C, I2).contiguous()


def _gate_up_bias_to_litsft(hf: Any) -> Any:
    """(E, 2I) interleaved -> (E, 2I) gate then up."""
    E, I2 = hf.shape
    return hf.reshape(E, I2 // 2, 2).transpose(1, 2).reshape(E, I2).contiguous()


def _gate_up_bias_to_hf(litsft: Any) -> Any:
    E, I2 = litsft.shape
    return litsft.reshape(E, 2, I2 // 2).transpose(1, 2).reshape(E, I2).contiguous()


def _swap_last_dims(tensor: Any) -> Any:
    """down_proj: transformers' (E, I, C) <-> litsft's (E, C, I)."""
    return tensor.transpose(1, 2).contiguous()


EXPERT_LAYOUTS = {
    "blocks.{i}.mlp.experts.gate_up_proj": Layout(_gate_up_to_litsft, _gate_up_to_hf),
    "blocks.{i}.mlp.experts.gate_up_proj_bias": Layout(_gate_up_bias_to_litsft, _gate_up_bias_to_hf),
    "blocks.{i}.mlp.experts.down_proj": Layout(_swap_last_dims, _swap_last_dims),
}
GPT_OSS_WEIGHTS = WeightMap(
    {
        **{litsft: hf for litsft, hf in LLAMA_WEIGHT_NAMES.items() if ".mlp." not in litsft},
        "blocks.{i}.attn.sinks": "model.layers.{i}.self_attn.sinks",
        "blocks.{i}.mlp.router.weight": "model.layers.{i}.mlp.router.weight",
        "blocks.{i}.mlp.router.bias": "model.layers.{i}.mlp.router.bias",
        **{name: name.replace("blocks.{i}.", "model.layers.{i}.") for name in EXPERT_LAYOUTS},
        "blocks.{i}.mlp.experts.down_proj_bias": "model.layers.{i}.mlp.experts.down_proj_bias",
    },
    layouts=EXPERT_LAYOUTS,
)
GPT_OSS_DEFAULTS = {
    "sliding_window": 128,
    "attention_bias": True,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
"""transformers' GptOssConfig defaults for the keys gpt-oss reads."""
GPT_OSS_BLOCK_VALUES = dict(
    attention_sinks=True,
    router_bias=True,
    router_softmax="top_k",
    expert_bias=True,
    expert_activation="clamped_swiglu",
)
"""The `Config` fields every gpt-oss model sets."""


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    quantization = hf_config.get("quantization_config")
    if quantization is not None and quantization.get("quant_method") != QUANTIZATION_METHOD:
        raise LitsftError(
            f"quantization_config's quant_method is {quantization.get('quant_method')!r}, but litsft converts "
            f"gpt-oss in bf16 or from the hub's {QUANTIZATION_METHOD} only; use the original checkpoint"
        )

    def get(key: str) -> Any:
        return hf_config.get(key, GPT_OSS_DEFAULTS.get(key))

    layers = hf_config["num_hidden_layers"]
    layer_types = hf_config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    return {
        **attention_biases({"attention_bias": get("attention_bias")}),
        **routed_experts_from_hf(hf_config, EXPERT_COUNT_KEYS),
        **GPT_OSS_BLOCK_VALUES,
        "sliding_window": get("sliding_window"),
        "layer_types": list(layer_types),
        "swiglu_alpha": float(get("swiglu_alpha")),
        "swiglu_limit": float(get("swiglu_limit")),
    }


def _hf_from_config(config: Any) -> dict[str, Any]:
    if config.sliding_window is None:
        layer_types = ["full_attention"] * config.num_layers
    else:
        layer_types = config.layer_types or ["sliding_attention"] * config.num_layers
    return {
        "attention_bias": config.out_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(layer_types),
        "intermediate_size": config.expert_intermediate,  # every MLP is routed: this is the experts' width
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
    }


# 201088 tokens, head_dim 64, 64 query and 8 kv heads, experts as wide as the model (2880), 4 per token,
# RoPE theta 150000 with YaRN (factor 32 over 4096 positions, not truncated), a 128-token window on even layers,
# router_aux_loss_coef 0.9; <|endoftext|> 199999 pads, <|return|> 200002 ends.
GPT_OSS_VALUES = dict(
    vocab_size=201088,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=150000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    qkv_bias=True,
    out_bias=True,
    sliding_window=128,
    experts_per_token=4,
    router_aux_loss_coef=0.9,
    eos_token_id=200002,
    hf_architecture="GptOssForCausalLM",
    **GPT_OSS_BLOCK_VALUES,
)
NAMED: dict[str, dict[str, Any]] = {}
# A tiny gpt-oss for tests: every feature above, 4 experts of 2 per token, a window that 64-token rows reach past.
TINY_GPT_OSS_VALUES = dict(
    GPT_OSS_VALUES,
    **{**TINY_VALUES, "rope_theta": 150000.0},
    head_dim=16,
    sliding_window=16,
    num_experts=4,
    experts_per_token=2,
    layer_types=["sliding_attention", "full_attention"],
    rope_scaling={**GPT_OSS_VALUES["rope_scaling"], "factor": 4.0, "original_max_position_embeddings": 32},
)
NAMED.update([published("tiny-gpt-oss", 2, 64, 4, 2, 64, **TINY_GPT_OSS_VALUES)])
for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    NAMED.update(
        [
            published(
                name,
                layers,
                2880,
                64,
                8,
                2880,
                **GPT_OSS_VALUES,
                num_experts=experts,
                layer_types=layer_types,
            )
        ]
    )

GPT_OSS_FAMILY = register_family(
    Family(
        architecture="GptOssForCausalLM",
        model_type="gpt_oss",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=ROUTED_EXPERT_KEYS
        | {
            "attention_bias",
            "sliding_window",
            "layer_types",
            "swiglu_alpha",
            "swiglu_limit",
            "quantization_config",
            *EXPERT_COUNT_KEYS,
        },
        hf_keys_ignored={
            **DECODER_IGNORED,
            **MOE_IGNORED,
            "hidden_act": harmless(
                "transformers' gpt-oss experts apply their clamped SwiGLU whatever it names; so do litsft's"
            ),
        },
        weights=GPT_OSS_WEIGHTS,
        named_configs=NAMED,
    )
)
