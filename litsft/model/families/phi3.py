"""Phi-3 and Phi-4 (transformers' Phi3ForCausalLM): Llama's block with q, k and v stored as one `qkv_proj`
tensor and gate and up as one `gate_up_proj` (split on import, joined again on export), a sliding window on
every layer when config.json sets one, LongRoPE for the long-context models, and partial rotary (Phi-4-mini
rotates 3/4 of each head).

Sources of the named configs, each model's config.json:
https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json,
https://huggingface.co/microsoft/Phi-3-mini-128k-instruct/blob/main/config.json,
https://huggingface.co/microsoft/phi-4/blob/main/config.json (its eos, <|im_end|>, from generation_config.json
of the same repository), https://huggingface.co/microsoft/Phi-4-mini-instruct/blob/main/config.json.
tests/test_model_config.py repeats the key numbers in a table of its own, so a typo here fails a test.
"""

from __future__ import annotations

from typing import Any

from litsft.errors import LitsftError
from litsft.model.families.spec import (
    DECODER_IGNORED,
    LLAMA_WEIGHT_NAMES,
    LONG_ROPE_TYPES,
    Family,
    IgnoredKey,
    WeightMap,
    harmless,
    published,
    register_family,
    unsupported,
)

_FUSED_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

PHI3_WEIGHTS = WeightMap(
    {
        litsft: hf
        for litsft, hf in LLAMA_WEIGHT_NAMES.items()
        if not any(part in litsft for part in _FUSED_PARTS)
    },
    fused={
        "model.layers.{i}.self_attn.qkv_proj.weight": (
            "blocks.{i}.attn.q_proj.weight",
            "blocks.{i}.attn.k_proj.weight",
            "blocks.{i}.attn.v_proj.weight",
        ),
        "model.layers.{i}.mlp.gate_up_proj.weight": (
            "blocks.{i}.mlp.gate_proj.weight",
            "blocks.{i}.mlp.up_proj.weight",
        ),
    },
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)


def _rope_type(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


PHI3_KEYS = frozenset({"sliding_window", "partial_rotary_factor", "original_max_position_embeddings"})
"""The config.json keys `_config_from_hf` reads."""
PHI3_IGNORED: dict[str, IgnoredKey] = {
    **DECODER_IGNORED,
    "embd_pdrop": harmless("transformers' Phi3 model never reads it (it has no embedding dropout)"),
    "resid_pdrop": unsupported(
        "dropout on each block's outputs while training; litsft drops attention only", 0.0
    ),
}


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Phi3's own keys: the window (on every layer, as Mistral's), partial_rotary_factor (top level, or in
    transformers >= 5's rope_parameters), and for LongRoPE the top-level original_max_position_embeddings, which
    transformers prefers to a value inside the rope dict; it is kept in `rope_scaling` with the factors."""
    rope_parameters = hf_config.get("rope_parameters") or {}
    fraction = hf_config.get("partial_rotary_factor") or rope_parameters.get("partial_rotary_factor") or 1.0
    fields: dict[str, Any] = {
        "sliding_window": hf_config.get("sliding_window"),
        "rotary_fraction": float(fraction),
        "qkv_bias": False,
        "out_bias": False,
    }
    rope = dict(hf_config.get("rope_scaling") or rope_parameters)
    if _rope_type(rope) in LONG_ROPE_TYPES:
        rope = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        original = hf_config.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or rope.get(
            "original_max_position_embeddings", hf_config.get("max_position_embeddings", 4096)
        )
        fields["rope_scaling"] = rope
    return fields


def _hf_from_config(config: Any) -> dict[str, Any]:
    if config.layer_types is not None:
        raise LitsftError(
            f"{config.name}: Phi3ForCausalLM windows every layer or none; its config.json has no layer_types"
        )
    # Phi3Config's default pad id, 32000, is Phi-3-mini's: past the vocabulary of another model. An imported
    # config.json's own pad id is kept in hf_extra and written over this.
    hf: dict[str, Any] = {"sliding_window": config.sliding_window, "pad_token_id": None}
    if config.rotary_fraction != 1.0:
        hf["partial_rotary_factor"] = config.rotary_fraction
    scaling = dict(config.rope_scaling or {})
    if _rope_type(scaling) in LONG_ROPE_TYPES:
        hf["original_max_position_embeddings"] = scaling.pop("original_max_position_embeddings")
        hf["rope_scaling"] = scaling
    return hf


def longrope(original: int, short_factor: list[float], long_factor: list[float]) -> dict[str, Any]:
    """Phi-3's rope_scaling as config.json writes it, with its top-level original_max_position_embeddings."""
    return {
        "type": "longrope",
        "short_factor": short_factor,
        "long_factor": long_factor,
        "original_max_position_embeddings": original,
    }


# Phi-3-mini: MHA (32 heads of 96), 32064 tokens (Llama 2's 32000 and the chat tokens), <|endoftext|> 32000.
PHI3_MINI_VALUES = dict(
    vocab_size=32064, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=32000
)
# Phi-3-mini-128k-instruct's LongRoPE factors, one per rotated pair of its 96-wide heads.
PHI3_MINI_128K_LONG_FACTOR = [
    1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
    1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
    6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
    14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
    38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
    54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
    60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
    63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
    64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
    64.57435607910156, 64.69000244140625, 64.76000213623047,
]  # fmt: skip
PHI3_MINI_128K_SHORT_FACTOR = [
    1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003, 1.4000000000000004,
    1.5500000000000005, *[2.000000000000001] * 17, *[2.0500000000000007] * 6, 2.1000000000000005,
    2.1000000000000005, 2.1500000000000004, 2.25, 2.25, 2.25, 2.25, 2.25, 2.3999999999999995,
    2.4499999999999993, 2.499999999999999, 2.6999999999999984, 2.6999999999999984, 2.7499999999999982,
    2.799999999999998, 2.8999999999999977, 3.049999999999997,
]  # fmt: skip
# Phi-4-mini: GQA 24/8 heads of 128, 3/4 of each rotated (48 factors), tied embeddings, o200k tokens.
PHI4_MINI_LONG_FACTOR = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533,
    5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
    14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
    32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16,
    47.77,
]  # fmt: skip

NAMED: dict[str, dict[str, Any]] = dict(
    [
        published(
            "Phi-3-mini-4k-instruct", 32, 3072, 32, 32, 8192, **PHI3_MINI_VALUES,
            max_position_embeddings=4096, sliding_window=2047, hf_architecture="Phi3ForCausalLM",
        ),
        published(
            "Phi-3-mini-128k-instruct", 32, 3072, 32, 32, 8192, **PHI3_MINI_VALUES,
            max_position_embeddings=131072, sliding_window=262144, hf_architecture="Phi3ForCausalLM",
            rope_scaling=longrope(4096, PHI3_MINI_128K_SHORT_FACTOR, PHI3_MINI_128K_LONG_FACTOR),
        ),
        published(
            "phi-4", 40, 5120, 40, 10, 17920, vocab_size=100352, rms_norm_eps=1e-5, rope_theta=250000.0,
            max_position_embeddings=16384, bos_token_id=100257, eos_token_id=100265,
            hf_architecture="Phi3ForCausalLM",
        ),
        published(
            "Phi-4-mini-instruct", 32, 3072, 24, 8, 8192, vocab_size=200064, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=131072, sliding_window=262144, rotary_fraction=0.75,
            tie_word_embeddings=True, bos_token_id=199999, eos_token_id=199999, hf_architecture="Phi3ForCausalLM",
            rope_scaling=longrope(4096, [1.0] * 48, PHI4_MINI_LONG_FACTOR),
        ),
    ]
)  # fmt: skip

PHI3_FAMILY = register_family(
    Family(
        architecture="Phi3ForCausalLM",
        model_type="phi3",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=PHI3_KEYS,
        hf_keys_ignored=PHI3_IGNORED,
        weights=PHI3_WEIGHTS,
        named_configs=NAMED,
    )
)
