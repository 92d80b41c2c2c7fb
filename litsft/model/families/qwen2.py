"""Qwen2 and Qwen2.5: Llama's block with a bias on q, k and v, and a sliding window on the layers that
`layer_types` (or, before it existed, `max_window_layers`) names, when `use_sliding_window` is set.

Sources of the named configs: Qwen/Qwen2.5-<size> and -Instruct,
https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json (and likewise for the others).
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.spec import DECODER_IGNORED, Family, published, register_family

WINDOW_KEYS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
"""The config.json keys `sliding_layers_from_hf` reads."""
DEFAULT_MAX_WINDOW_LAYERS = 28
"""transformers' Qwen2Config default: https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2/configuration_qwen2.py"""


def sliding_layers_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The window and each layer's attention type as transformers' Qwen2 and Qwen3 read them: only with
    `use_sliding_window`; where `layer_types` says "sliding_attention", else from `max_window_layers` on."""
    window = hf_config.get("sliding_window") if hf_config.get("use_sliding_window", False) else None
    if window is None:
        return {"sliding_window": None}
    num_layers = hf_config["num_hidden_layers"]
    first = hf_config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
    layer_types = hf_config.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    return {"sliding_window": window, "layer_types": list(layer_types)}


def sliding_layers_to_hf(config: Any) -> dict[str, Any]:
    if config.sliding_window is None:
        return {"sliding_window": None, "use_sliding_window": False}
    layer_types = config.layer_types or ["sliding_attention"] * config.num_layers
    first = layer_types.index("sliding_attention")
    hf: dict[str, Any] = {"sliding_window": config.sliding_window, "use_sliding_window": True}
    hf["max_window_layers"] = first
    if layer_types != ["full_attention"] * first + ["sliding_attention"] * (config.num_layers - first):
        hf["layer_types"] = list(layer_types)  # an order max_window_layers cannot say
    return hf


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {**sliding_layers_from_hf(hf_config), "qkv_bias": True, "out_bias": False}


# Qwen2.5: bias on q/k/v, theta 1e6; 0.5B-3B tie embeddings and have 151936 tokens, 7B+ have 152064. Base
# models end documents with <|endoftext|> (151643), Instruct turns with <|im_end|> (151645); Instruct
# config.json says max_position_embeddings 32768 and rms_norm_eps 1e-6 for every size, base 14B-72B use
# 1e-5 and the base context differs per size.
QWEN2_5_VALUES = dict(
    rope_theta=1000000.0,
    qkv_bias=True,
    bos_token_id=151643,
    eos_token_id=151643,
    hf_architecture="Qwen2ForCausalLM",
)
QWEN2_5_INSTRUCT_VALUES = dict(eos_token_id=151645, max_position_embeddings=32768, rms_norm_eps=1e-6)
NAMED: dict[str, dict[str, Any]] = {}
for size, *shape, vocab, tied, context, eps in (
    ("0.5B", 24, 896, 14, 2, 4864, 151936, True, 32768, 1e-6),
    ("1.5B", 28, 1536, 12, 2, 8960, 151936, True, 131072, 1e-6),
    ("3B", 36, 2048, 16, 2, 11008, 151936, True, 32768, 1e-6),
    ("7B", 28, 3584, 28, 4, 18944, 152064, False, 131072, 1e-6),
    ("14B", 48, 5120, 40, 8, 13824, 152064, False, 131072, 1e-5),
    ("32B", 64, 5120, 40, 8, 27648, 152064, False, 131072, 1e-5),
    ("72B", 80, 8192, 64, 8, 29568, 152064, False, 131072, 1e-5),
):
    sized = dict(
        vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=context, rms_norm_eps=eps
    )
    name, base = published(f"Qwen2.5-{size}", *shape, **QWEN2_5_VALUES, **sized)
    NAMED[name] = base
    NAMED[f"{name}-Instruct"] = {**base, "name": f"{name}-Instruct", **QWEN2_5_INSTRUCT_VALUES}

QWEN2_FAMILY = register_family(
    Family(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        config_from_hf=_config_from_hf,
        hf_from_config=sliding_layers_to_hf,
        hf_keys_read=WINDOW_KEYS,
        hf_keys_ignored=DECODER_IGNORED,
        named_configs=NAMED,
    )
)
