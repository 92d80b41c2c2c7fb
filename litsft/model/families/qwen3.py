"""Qwen3: Qwen2's layout without the q/k/v bias, with RMSNorm on each head's queries and keys.

Sources of the named configs: Qwen/Qwen3-<size> (the post-trained releases),
https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (and likewise for the others).
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.llama import attention_biases
from litsft.model.families.qwen2 import WINDOW_KEYS, sliding_layers_from_hf, sliding_layers_to_hf
from litsft.model.families.spec import DECODER_IGNORED, Family, published, register_family


def _config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {**attention_biases(hf_config), **sliding_layers_from_hf(hf_config), "qk_norm": True}


def _hf_from_config(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.out_bias, **sliding_layers_to_hf(config)}


# head_dim 128 whatever the width, 151936 tokens, theta 1e6, max_position_embeddings 40960; 0.6B-4B tie
# embeddings. The pretrained "-Base" releases differ in context length and eos; convert their config.json.
QWEN3_VALUES = dict(
    vocab_size=151936,
    head_dim=128,
    qk_norm=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
    hf_architecture="Qwen3ForCausalLM",
)
NAMED: dict[str, dict[str, Any]] = {}
for size, *shape, tied in (
    ("0.6B", 28, 1024, 16, 8, 3072, True),
    ("1.7B", 28, 2048, 16, 8, 6144, True),
    ("4B", 36, 2560, 32, 8, 9728, True),
    ("8B", 36, 4096, 32, 8, 12288, False),
    ("14B", 40, 5120, 40, 8, 17408, False),
    ("32B", 64, 5120, 64, 8, 25600, False),
):
    NAMED.update([published(f"Qwen3-{size}", *shape, **QWEN3_VALUES, tie_word_embeddings=tied)])

QWEN3_FAMILY = register_family(
    Family(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        config_from_hf=_config_from_hf,
        hf_from_config=_hf_from_config,
        hf_keys_read=WINDOW_KEYS | {"attention_bias"},
        hf_keys_ignored=DECODER_IGNORED,
        named_configs=NAMED,
    )
)
