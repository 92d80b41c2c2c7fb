"""Gemma 3, text only (Gemma3ForCausalLM): Gemma 2's block (litsft.model.families.gemma2) with RMSNorm on each
head's queries and keys and no soft-capping; five sliding layers for every full one, and the sliding layers
rotate with their own RoPE base (rope_local_base_freq, 1e4) while the full ones use rope_theta (1e6) with
the model's rope_scaling (linear, factor 8, from 4B up).

Sources of the named configs: https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json, and the
`text_config` of https://huggingface.co/google/gemma-3-4b-it/blob/main/config.json (likewise 12b-it and
27b-it; the multimodal releases: litsft reads the language model). The keys those leave out take
transformers' Gemma3TextConfig defaults (among them 8 heads, 4 kv heads, head_dim 256, 262208 tokens),
https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma3/configuration_gemma3.py.
"""

from __future__ import annotations

from typing import Any

from litsft.errors import LitsftError
from litsft.model.families.gemma2 import (
    GEMMA_BLOCK_VALUES,
    GEMMA_IGNORED,
    GEMMA_KEYS,
    GEMMA_WEIGHTS,
    gemma_from_hf,
    gemma_to_hf,
)
from litsft.model.families.spec import Family, published, register_family

GEMMA3_DEFAULTS = {
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "sliding_window": 4096,
}
"""transformers' Gemma3TextConfig defaults for the keys Gemma 3 reads."""
GLOBAL_THETA, LOCAL_THETA = 1000000.0, 10000.0
"""Gemma3TextConfig.default_theta: the full layers' and the sliding layers' RoPE bases."""


def _rope_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Both RoPEs: from transformers >= 5's `rope_parameters` per layer type, or the published keys."""
    parameters = hf_config.get("rope_parameters") or {}
    if "full_attention" in parameters:
        full = dict(parameters["full_attention"])
        local = dict(parameters.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", GLOBAL_THETA), local.pop("rope_theta", LOCAL_THETA)
        scaling: dict[str, Any] | None = full
        if local.get("rope_type", "default") != "default":
            raise LitsftError(
                f"rope_parameters.sliding_attention has rope_type {local['rope_type']!r}; litsft's Gemma 3 "
                "rotates its sliding layers with plain RoPE only"
            )
    else:
        theta = hf_config.get("rope_theta") or parameters.get("rope_theta") or GLOBAL_THETA
        local_theta = hf_config.get("rope_local_base_freq", LOCAL_THETA)
        scaling = hf_config.get("rope_scaling") or {k: v for k, v in parameters.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return dict(rope_theta=float(theta), rope_local_base=float(local_theta), rope_scaling=scaling)


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    fields = gemma_from_hf(hf_config, GEMMA3_DEFAULTS, sliding_every=6)
    return {**fields, **_rope_from_hf(hf_config), "qk_norm": True}


def _hf_from_config(config: Any) -> dict[str, Any]:
    # rope_theta and rope_scaling (the full layers') are written with the shared keys.
    return {**gemma_to_hf(config), "rope_local_base_freq": config.rope_local_base}


# 1B: 262144 tokens, 32768 positions, a 512-token window, no rope scaling. 4B-27B: 262208 tokens, 131072
# positions, a 1024-token window, the full layers' RoPE scaled linearly by 8. <bos> 2; the -it releases stop
# at <eos> (1) or <end_of_turn> (106).
GEMMA3_VALUES = dict(
    rope_theta=GLOBAL_THETA,
    rope_local_base=LOCAL_THETA,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qk_norm=True,
    bos_token_id=2,
    eos_token_id=[1, 106],
    hf_architecture="Gemma3ForCausalLM",
    **GEMMA_BLOCK_VALUES,
)
NAMED: dict[str, dict[str, Any]] = {}
for size, *shape, head_dim, scalar in (
    ("1b", 26, 1152, 4, 1, 6912, 256, 256),
    ("4b", 34, 2560, 8, 4, 10240, 256, 256),
    ("12b", 48, 3840, 16, 8, 15360, 256, 256),
    ("27b", 62, 5376, 32, 16, 21504, 128, 168),
):
    small = size == "1b"
    sized = dict(
        head_dim=head_dim,
        query_pre_attn_scalar=scalar,
        vocab_size=262144 if small else 262208,
        max_position_embeddings=32768 if small else 131072,
        sliding_window=512 if small else 1024,
        rope_scaling=None if small else {"rope_type": "linear", "factor": 8.0},
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(shape[0])],
    )
    NAMED.update([published(f"gemma-3-{size}-it", *shape, **GEMMA3_VALUES, **sized)])

GEMMA3_FAMILY = register_family(
    Family(
        architecture="Gemma3ForCausalLM",
        model_type="gemma3_text",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=GEMMA_KEYS | {"rope_local_base_freq"},
        hf_keys_ignored=GEMMA_IGNORED,
        weights=GEMMA_WEIGHTS,
        named_configs=NAMED,
    )
)
