"""Mistral: Llama's block, with a sliding window on every layer when config.json sets `sliding_window`.

Sources of the named configs: mistralai/Mistral-7B-v0.1, -v0.3 and their -Instruct- releases,
https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json (and likewise for the others).
"""

from __future__ import annotations

from typing import Any

from litsft.errors import LitsftError
from litsft.model.families.spec import DECODER_IGNORED, Family, published, register_family


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": hf_config.get("sliding_window")}


def _hf_from_config(config: Any) -> dict[str, Any]:
    if config.layer_types is not None:
        raise LitsftError(
            f"{config.name}: MistralForCausalLM windows every layer or none; its config.json has no layer_types"
        )
    return {"sliding_window": config.sliding_window}


# v0.1 attends within a 4096-token sliding window (RoPE theta 1e4, 32000 tokens); v0.3 has no window,
# theta 1e6 and 32768 tokens.
MISTRAL_VALUES = dict(
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    hf_architecture="MistralForCausalLM",
)
NAMED: dict[str, dict[str, Any]] = {}
for version, own in (
    ("v0.1", dict(vocab_size=32000, rope_theta=10000.0, sliding_window=4096)),
    ("v0.3", dict(vocab_size=32768, rope_theta=1000000.0)),
):
    for kind in ("", "Instruct-"):
        NAMED.update(
            [published(f"Mistral-7B-{kind}{version}", 32, 4096, 32, 8, 14336, **MISTRAL_VALUES, **own)]
        )

MISTRAL_FAMILY = register_family(
    Family(
        architecture="MistralForCausalLM",
        model_type="mistral",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=frozenset({"sliding_window"}),
        hf_keys_ignored=DECODER_IGNORED,
        named_configs=NAMED,
    )
)
