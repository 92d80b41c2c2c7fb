"""Llama (Llama 2, Llama 3, 3.1, 3.2), and the models built on its architecture (SmolLM2, TinyLlama), plus the
tiny shapes the tests and the demo use.

Sources of the named configs: each model's published config.json,
https://huggingface.co/<org>/<name>/blob/main/config.json (the org is named above each group), and LitGPT's
table of the same models, https://github.com/Lightning-AI/litgpt/blob/main/litgpt/config.py.
tests/test_model_config.py repeats the key numbers in a table of its own, so a typo here fails a test.
"""

from __future__ import annotations

from typing import Any

from litsft.model.families.spec import (
    DECODER_IGNORED,
    Family,
    IgnoredKey,
    harmless,
    published,
    register_family,
)


def attention_biases(hf_config: dict[str, Any]) -> dict[str, Any]:
    """transformers' `attention_bias`: a bias on q, k, v and o alike (Llama, Qwen3, Gemma, OLMo 2, Granite)."""
    bias = bool(hf_config.get("attention_bias", False))
    return {"qkv_bias": bias, "out_bias": bias}


LLAMA_IGNORED: dict[str, IgnoredKey] = {
    **DECODER_IGNORED,
    "pretraining_tp": harmless(
        "how many slices Meta's pretraining split each matmul into; transformers computes the same product whole"
    ),
}


def _hf_from_config(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.out_bias, "mlp_bias": False}


NAMED: dict[str, dict[str, Any]] = {}


def _add(*named: tuple[str, dict[str, Any]]) -> None:
    NAMED.update(named)


def _variant(base: tuple[str, dict[str, Any]], name: str, **changes: Any) -> tuple[str, dict[str, Any]]:
    return name, {**base[1], "name": name, **changes}


# Tiny models for tests and the demo: shapes that exercise GQA, biases and norms in seconds on a CPU.
TINY_VALUES = dict(vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0, torch_dtype="float32")
_add(
    published("tiny-llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=176, **TINY_VALUES),
    published("demo-llama", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=352, **TINY_VALUES),
)

# Llama 2: meta-llama/Llama-2-{7,13,70}b-hf and -chat-hf (the same config.json); fp16 weights.
LLAMA2_VALUES = dict(
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float16",
)
for size, *shape in (
    ("7b", 32, 4096, 32, 32, 11008),
    ("13b", 40, 5120, 40, 40, 13824),
    ("70b", 80, 8192, 64, 8, 28672),
):
    _add(
        published(f"Llama-2-{size}-hf", *shape, **LLAMA2_VALUES),
        published(f"Llama-2-{size}-chat-hf", *shape, **LLAMA2_VALUES),
    )

# Llama 3, 3.1, 3.2 (meta-llama/Meta-Llama-3-8B, Llama-3.1-8B-Instruct, ...): 128256-token vocab, RoPE
# theta 500000. Instruct releases stop at <|eot_id|> (128009); 3.1 and 3.2 Instruct list
# [<|end_of_text|>, <|eom_id|>, <|eot_id|>] in config.json's eos_token_id.
LLAMA3_VALUES = dict(
    vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001
)
LLAMA_3_1_INSTRUCT_EOS = [128001, 128008, 128009]


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


for size, *shape in (("8B", 32, 4096, 32, 8, 14336), ("70B", 80, 8192, 64, 8, 28672)):
    base = published(f"Meta-Llama-3-{size}", *shape, **LLAMA3_VALUES, max_position_embeddings=8192)
    _add(base, _variant(base, f"Meta-Llama-3-{size}-Instruct", eos_token_id=128009))
for size, *shape in (
    ("8B", 32, 4096, 32, 8, 14336),
    ("70B", 80, 8192, 64, 8, 28672),
    ("405B", 126, 16384, 128, 8, 53248),
):
    base = published(
        f"Llama-3.1-{size}",
        *shape,
        **LLAMA3_VALUES,
        max_position_embeddings=131072,
        rope_scaling=_llama3_rope(8.0),
    )
    _add(base, _variant(base, f"Llama-3.1-{size}-Instruct", eos_token_id=LLAMA_3_1_INSTRUCT_EOS))
# Llama 3.2 shares the input embedding with the output head (meta-llama/Llama-3.2-1B config.json: head_dim
# 64, rope factor 32, tie_word_embeddings true).
for size, *shape in (("1B", 16, 2048, 32, 8, 8192), ("3B", 28, 3072, 24, 8, 8192)):
    base = published(
        f"Llama-3.2-{size}",
        *shape,
        **LLAMA3_VALUES,
        max_position_embeddings=131072,
        rope_scaling=_llama3_rope(32.0),
        tie_word_embeddings=True,
    )
    _add(base, _variant(base, f"Llama-3.2-{size}-Instruct", eos_token_id=LLAMA_3_1_INSTRUCT_EOS))

# SmolLM2 (HuggingFaceTB/SmolLM2-<size>, the base models): Llama architecture, tied embeddings, 49152
# tokens, token 0 as bos and eos. The -Instruct releases use other token ids; convert their config.json.
SMOLLM2_VALUES = dict(
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)
for size, *shape, theta in (
    ("135M", 30, 576, 9, 3, 1536, 100000.0),
    ("360M", 32, 960, 15, 5, 2560, 100000.0),
    ("1.7B", 24, 2048, 32, 32, 8192, 130000.0),
):
    _add(published(f"SmolLM2-{size}", *shape, **SMOLLM2_VALUES, rope_theta=theta))

# TinyLlama 1.1B: "TinyLlama-1.1B" is TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T (fp32 weights),
# the chat model TinyLlama/TinyLlama-1.1B-Chat-v1.0.
TINY_LLAMA_VALUES = dict(
    vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2
)
_add(
    published("TinyLlama-1.1B", 22, 2048, 32, 4, 5632, **TINY_LLAMA_VALUES, torch_dtype="float32"),
    published("TinyLlama-1.1B-Chat-v1.0", 22, 2048, 32, 4, 5632, **TINY_LLAMA_VALUES),
)

LLAMA_FAMILY = register_family(
    Family(
        architecture="LlamaForCausalLM",
        model_type="llama",
        config_from_hf=attention_biases,
        hf_from_config=_hf_from_config,
        hf_keys_read=frozenset({"attention_bias"}),
        hf_keys_ignored=LLAMA_IGNORED,
        named_configs=NAMED,
    )
)
