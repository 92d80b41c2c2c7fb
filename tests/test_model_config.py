import dataclasses
import json

import pytest
import torch
from tiny_configs import tiny_shape
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from litsft.errors import LitsftError
from litsft.model.accounting.sizes import list_models, model_sizes, num_parameters
from litsft.model.config import NAMED_CONFIGS, Config, format_count
from litsft.model.families import FAMILIES

# The published numbers, typed in again from each model's config.json rather than copied from
# litsft/model/config.py, so a typo in either place fails a test:
# name: (layers, heads, kv heads, hidden, intermediate, vocab, rope theta, tied embeddings)
PUBLISHED = {
    "tiny-llama": (2, 4, 2, 64, 176, 512, 1e4, False),
    "demo-llama": (4, 4, 2, 128, 352, 512, 1e4, False),
    "Llama-2-7b-hf": (32, 32, 32, 4096, 11008, 32000, 1e4, False),
    "Llama-2-7b-chat-hf": (32, 32, 32, 4096, 11008, 32000, 1e4, False),
    "Llama-2-13b-hf": (40, 40, 40, 5120, 13824, 32000, 1e4, False),
    "Llama-2-13b-chat-hf": (40, 40, 40, 5120, 13824, 32000, 1e4, False),
    "Llama-2-70b-hf": (80, 64, 8, 8192, 28672, 32000, 1e4, False),
    "Llama-2-70b-chat-hf": (80, 64, 8, 8192, 28672, 32000, 1e4, False),
    "Meta-Llama-3-8B": (32, 32, 8, 4096, 14336, 128256, 5e5, False),
    "Meta-Llama-3-8B-Instruct": (32, 32, 8, 4096, 14336, 128256, 5e5, False),
    "Meta-Llama-3-70B": (80, 64, 8, 8192, 28672, 128256, 5e5, False),
    "Meta-Llama-3-70B-Instruct": (80, 64, 8, 8192, 28672, 128256, 5e5, False),
    "Llama-3.1-8B": (32, 32, 8, 4096, 14336, 128256, 5e5, False),
    "Llama-3.1-8B-Instruct": (32, 32, 8, 4096, 14336, 128256, 5e5, False),
    "Llama-3.1-70B": (80, 64, 8, 8192, 28672, 128256, 5e5, False),
    "Llama-3.1-70B-Instruct": (80, 64, 8, 8192, 28672, 128256, 5e5, False),
    "Llama-3.1-405B": (126, 128, 8, 16384, 53248, 128256, 5e5, False),
    "Llama-3.1-405B-Instruct": (126, 128, 8, 16384, 53248, 128256, 5e5, False),
    "Llama-3.2-1B": (16, 32, 8, 2048, 8192, 128256, 5e5, True),
    "Llama-3.2-1B-Instruct": (16, 32, 8, 2048, 8192, 128256, 5e5, True),
    "Llama-3.2-3B": (28, 24, 8, 3072, 8192, 128256, 5e5, True),
    "Llama-3.2-3B-Instruct": (28, 24, 8, 3072, 8192, 128256, 5e5, True),
    "Mistral-7B-v0.1": (32, 32, 8, 4096, 14336, 32000, 1e4, False),
    "Mistral-7B-Instruct-v0.1": (32, 32, 8, 4096, 14336, 32000, 1e4, False),
    "Mistral-7B-v0.3": (32, 32, 8, 4096, 14336, 32768, 1e6, False),
    "Mistral-7B-Instruct-v0.3": (32, 32, 8, 4096, 14336, 32768, 1e6, False),
    "Qwen2.5-0.5B": (24, 14, 2, 896, 4864, 151936, 1e6, True),
    "Qwen2.5-0.5B-Instruct": (24, 14, 2, 896, 4864, 151936, 1e6, True),
    "Qwen2.5-1.5B": (28, 12, 2, 1536, 8960, 151936, 1e6, True),
    "Qwen2.5-1.5B-Instruct": (28, 12, 2, 1536, 8960, 151936, 1e6, True),
    "Qwen2.5-3B": (36, 16, 2, 2048, 11008, 151936, 1e6, True),
    "Qwen2.5-3B-Instruct": (36, 16, 2, 2048, 11008, 151936, 1e6, True),
    "Qwen2.5-7B": (28, 28, 4, 3584, 18944, 152064, 1e6, False),
    "Qwen2.5-7B-Instruct": (28, 28, 4, 3584, 18944, 152064, 1e6, False),
    "Qwen2.5-14B": (48, 40, 8, 5120, 13824, 152064, 1e6, False),
    "Qwen2.5-14B-Instruct": (48, 40, 8, 5120, 13824, 152064, 1e6, False),
    "Qwen2.5-32B": (64, 40, 8, 5120, 27648, 152064, 1e6, False),
    "Qwen2.5-32B-Instruct": (64, 40, 8, 5120, 27648, 152064, 1e6, False),
    "Qwen2.5-72B": (80, 64, 8, 8192, 29568, 152064, 1e6, False),
    "Qwen2.5-72B-Instruct": (80, 64, 8, 8192, 29568, 152064, 1e6, False),
    "Qwen3-0.6B": (28, 16, 8, 1024, 3072, 151936, 1e6, True),
    "Qwen3-1.7B": (28, 16, 8, 2048, 6144, 151936, 1e6, True),
    "Qwen3-4B": (36, 32, 8, 2560, 9728, 151936, 1e6, True),
    "Qwen3-8B": (36, 32, 8, 4096, 12288, 151936, 1e6, False),
    "Qwen3-14B": (40, 40, 8, 5120, 17408, 151936, 1e6, False),
    "Qwen3-32B": (64, 64, 8, 5120, 25600, 151936, 1e6, False),
    "SmolLM2-135M": (30, 9, 3, 576, 1536, 49152, 1e5, True),
    "SmolLM2-360M": (32, 15, 5, 960, 2560, 49152, 1e5, True),
    "SmolLM2-1.7B": (24, 32, 32, 2048, 8192, 49152, 1.3e5, True),
    "TinyLlama-1.1B": (22, 32, 4, 2048, 5632, 32000, 1e4, False),
    "TinyLlama-1.1B-Chat-v1.0": (22, 32, 4, 2048, 5632, 32000, 1e4, False),
    "Phi-3-mini-4k-instruct": (32, 32, 32, 3072, 8192, 32064, 1e4, False),
    "Phi-3-mini-128k-instruct": (32, 32, 32, 3072, 8192, 32064, 1e4, False),
    "phi-4": (40, 40, 10, 5120, 17920, 100352, 2.5e5, False),
    "Phi-4-mini-instruct": (32, 24, 8, 3072, 8192, 200064, 1e4, True),
    "tiny-gemma2": (2, 4, 2, 64, 176, 512, 1e4, True),
    "gemma-2-2b": (26, 8, 4, 2304, 9216, 256000, 1e4, True),
    "gemma-2-2b-it": (26, 8, 4, 2304, 9216, 256000, 1e4, True),
    "gemma-2-9b": (42, 16, 8, 3584, 14336, 256000, 1e4, True),
    "gemma-2-27b": (46, 32, 16, 4608, 36864, 256000, 1e4, True),
    "gemma-3-1b-it": (26, 4, 1, 1152, 6912, 262144, 1e6, True),
    "gemma-3-4b-it": (34, 8, 4, 2560, 10240, 262208, 1e6, True),
    "gemma-3-12b-it": (48, 16, 8, 3840, 15360, 262208, 1e6, True),
    "gemma-3-27b-it": (62, 32, 16, 5376, 21504, 262208, 1e6, True),
    "OLMo-2-0425-1B": (16, 16, 16, 2048, 8192, 100352, 5e5, False),
    "OLMo-2-1124-7B": (32, 32, 32, 4096, 11008, 100352, 5e5, False),
    "OLMo-2-1124-13B": (40, 40, 40, 5120, 13824, 100352, 5e5, False),
    "tiny-granite": (2, 4, 2, 64, 176, 512, 1e4, False),
    "granite-3.1-2b-instruct": (40, 32, 8, 2048, 8192, 49155, 5e6, True),
    "OLMoE-1B-7B-0924": (16, 16, 16, 2048, 1024, 50304, 1e4, False),
    "OLMoE-1B-7B-0924-Instruct": (16, 16, 16, 2048, 1024, 50304, 1e4, False),
    "Qwen3-30B-A3B": (48, 32, 4, 2048, 6144, 151936, 1e6, False),
    "Qwen3-235B-A22B": (94, 64, 4, 4096, 12288, 151936, 1e6, False),
    "Mixtral-8x7B-v0.1": (32, 32, 8, 4096, 14336, 32000, 1e6, False),
    "Mixtral-8x7B-Instruct-v0.1": (32, 32, 8, 4096, 14336, 32000, 1e6, False),
    "Mixtral-8x22B-v0.1": (56, 48, 8, 6144, 16384, 32000, 1e6, False),
    "Qwen1.5-MoE-A2.7B": (24, 16, 16, 2048, 5632, 151936, 1e6, False),
    "Qwen2-57B-A14B": (28, 28, 4, 3584, 18944, 151936, 1e6, False),
    "tiny-qwen2-moe": (2, 4, 2, 64, 176, 512, 1e6, False),
    "gpt-oss-20b": (24, 64, 8, 2880, 2880, 201088, 150000.0, False),
    "gpt-oss-120b": (36, 64, 8, 2880, 2880, 201088, 150000.0, False),
    "tiny-gpt-oss": (2, 4, 2, 64, 64, 512, 150000.0, False),
}

# The mixtures of experts' own numbers, from the same config.json files: experts, experts per token, an
# expert's intermediate size, renormalized top-k weights, router_aux_loss_coef.
MOE_PUBLISHED = {
    "OLMoE-1B-7B-0924": (64, 8, 1024, False, 0.01),
    "OLMoE-1B-7B-0924-Instruct": (64, 8, 1024, False, 0.01),
    "Qwen3-30B-A3B": (128, 8, 768, True, 0.001),
    "Qwen3-235B-A22B": (128, 8, 1536, True, 0.001),
    "Mixtral-8x7B-v0.1": (8, 2, 14336, True, 0.02),
    "Mixtral-8x7B-Instruct-v0.1": (8, 2, 14336, True, 0.02),
    "Mixtral-8x22B-v0.1": (8, 2, 16384, True, 0.001),
    "Qwen1.5-MoE-A2.7B": (60, 4, 1408, False, 0.001),
    "Qwen2-57B-A14B": (64, 8, 2560, False, 0.001),
    "gpt-oss-20b": (32, 4, 2880, False, 0.9),
    "gpt-oss-120b": (128, 4, 2880, False, 0.9),
}

# Gemma's own numbers, from the same config.json files (Gemma 3 4B-27B: their text_config, the keys it leaves
# out at transformers' Gemma3TextConfig defaults): head_dim, query_pre_attn_scalar, sliding window, full
# layers (every n-th), attention and final soft-caps, the sliding layers' RoPE base, the full layers' rope
# scaling factor, max_position_embeddings.
GEMMA_PUBLISHED = {
    "gemma-2-2b": (256, 256, 4096, 2, 50.0, 30.0, None, None, 8192),
    "gemma-2-9b": (256, 256, 4096, 2, 50.0, 30.0, None, None, 8192),
    "gemma-2-27b": (128, 144, 4096, 2, 50.0, 30.0, None, None, 8192),
    "gemma-3-1b-it": (256, 256, 512, 6, None, None, 1e4, None, 32768),
    "gemma-3-4b-it": (256, 256, 1024, 6, None, None, 1e4, 8.0, 131072),
    "gemma-3-12b-it": (256, 256, 1024, 6, None, None, 1e4, 8.0, 131072),
    "gemma-3-27b-it": (128, 168, 1024, 6, None, None, 1e4, 8.0, 131072),
}

# Totals counted by instantiating each Hugging Face model on the meta device (test below).
KNOWN_PARAMETER_COUNTS = {
    "Llama-2-7b-hf": 6_738_415_616,
    "Meta-Llama-3-8B": 8_030_261_248,
    "Qwen2.5-0.5B": 494_032_768,
    "TinyLlama-1.1B": 1_100_048_384,
    "gemma-2-2b": 2_614_341_888,
    "gemma-3-1b-it": 999_885_952,
    "OLMo-2-0425-1B": 1_484_916_736,
    "granite-3.1-2b-instruct": 2_533_531_648,
    "OLMoE-1B-7B-0924": 6_919_161_856,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen1.5-MoE-A2.7B": 14_315_784_192,
    # OpenAI's model card gives 20.91B and 116.83B, https://arxiv.org/abs/2508.10925
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
}


def hf_config_object(config: Config):
    hf = config.to_hf_config()
    hf.setdefault("pad_token_id", None)  # Phi3Config's default, 32000, is past a tiny vocabulary
    return AutoConfig.for_model(hf.pop("model_type"), **hf)


def meta_parameter_count(config: Config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_object(config))
    return sum(p.numel() for p in model.parameters())  # tied weights are yielded once


def test_every_named_config_has_published_numbers():
    assert set(PUBLISHED) == set(NAMED_CONFIGS)


@pytest.mark.parametrize("name", PUBLISHED)
def test_named_config_matches_published_numbers(name):
    c = Config.from_name(name)
    actual = (
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        c.rope_theta,
        c.tie_word_embeddings,
    )
    assert actual == PUBLISHED[name]


@pytest.mark.parametrize("name", MOE_PUBLISHED)
def test_moe_config_matches_published_numbers(name):
    c = Config.from_name(name)
    actual = (
        c.num_experts,
        c.experts_per_token,
        c.expert_intermediate,
        c.normalize_expert_weights,
        c.router_aux_loss_coef,
    )
    assert actual == MOE_PUBLISHED[name]


@pytest.mark.parametrize(
    "name, active",
    [
        ("OLMoE-1B-7B-0924", "1.28B"),
        ("Qwen3-30B-A3B", "3.35B"),
        ("Mixtral-8x7B-v0.1", "12.9B"),
        ("Qwen1.5-MoE-A2.7B", "2.69B"),
        ("Qwen2-57B-A14B", "14.2B"),
    ],
)
def test_active_parameters_are_those_of_the_k_experts_a_token_takes(name, active):
    """The "A3B" of Qwen3-30B-A3B: every parameter but the experts a token is not routed to (OLMoE's paper
    says 1.3B active, Mixtral's 12.9B; Qwen2-MoE's shared expert counts as active, as the "A2.7B" and "A14B" of
    its names do)."""
    assert format_count(model_sizes(Config.from_name(name)).active_parameters) == active


def test_family_specific_fields():
    llama31 = Config.from_name("Llama-3.1-8B-Instruct")
    assert llama31.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert (llama31.max_position_embeddings, llama31.eos_token_id) == (131072, [128001, 128008, 128009])
    assert Config.from_name("Llama-3.2-1B").rope_scaling["factor"] == 32.0
    assert Config.from_name("Meta-Llama-3-8B").rope_scaling is None
    assert Config.from_name("Mistral-7B-v0.1").sliding_window == 4096
    assert Config.from_name("Mistral-7B-v0.3").sliding_window is None
    assert all(Config.from_name(n).qkv_bias for n in PUBLISHED if n.startswith("Qwen2.5"))
    qwen3 = [Config.from_name(n) for n in PUBLISHED if n.startswith("Qwen3")]
    assert all(c.qk_norm and c.head_dim == 128 and not c.qkv_bias for c in qwen3)
    assert Config.from_name("Qwen2.5-7B-Instruct").eos_token_id == 151645
    assert Config.from_name("Qwen2.5-7B").eos_token_id == 151643
    assert Config.from_name("Llama-2-7b-hf").torch_dtype == "float16"


@pytest.mark.parametrize("name", GEMMA_PUBLISHED)
def test_gemma_configs_match_published_numbers(name):
    c = Config.from_name(name)
    full_every = next(i + 1 for i in range(c.num_layers) if c.attention_window(i) is None)
    assert [c.attention_window(i) is None for i in range(c.num_layers)] == [
        (i + 1) % full_every == 0 for i in range(c.num_layers)
    ]
    actual = (
        c.head_dim,
        c.query_pre_attn_scalar,
        c.sliding_window,
        full_every,
        c.softcap_attention,
        c.softcap_final,
        c.rope_local_base,
        (c.rope_scaling or {}).get("factor"),
        c.max_position_embeddings,
    )
    assert actual == GEMMA_PUBLISHED[name]
    assert c.norm_unit_offset and c.post_attention_norm and c.post_mlp_norm and c.scale_embeddings
    assert c.mlp_activation == "gelu_tanh" and c.qk_norm == name.startswith("gemma-3")


# Published config.json files as the hub serves them (keys litsft does not model left out: they are kept in
# hf_extra): https://huggingface.co/google/gemma-2-2b/blob/main/config.json,
# https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json,
# https://huggingface.co/allenai/OLMo-2-1124-7B/blob/main/config.json.
PUBLISHED_CONFIG_JSON = {
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": 30.0,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
    },
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
    },
    "OLMo-2-1124-7B": {
        "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "olmo2",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 100352,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", PUBLISHED_CONFIG_JSON)
def test_a_published_config_json_reads_as_the_named_config(name):
    """The hub's own config.json (Gemma's with hidden_act gelu_pytorch_tanh, no tie_word_embeddings and no
    layer_types; Gemma 3's with sliding_window_pattern and rope_local_base_freq) gives the named config."""
    config = Config.from_hf_config(PUBLISHED_CONFIG_JSON[name], name=name)
    named = Config.from_name(name)
    token_ids = dict(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    assert dataclasses.replace(config, hf_extra={}) == dataclasses.replace(named, **token_ids)


@pytest.mark.parametrize(
    "key", ["query_pre_attn_scalar", "softcap_attention", "softcap_final", "rope_local_base"]
)
def test_a_scale_or_cap_that_is_not_positive_is_refused(key):
    with pytest.raises(LitsftError) as error:
        Config.from_name("tiny-gemma2", **{key: 0.0})
    assert str(error.value) == f"tiny-gemma2: {key}=0.0 must be positive (or null for none)"


def test_gemma3_rope_parameters_per_layer_type():
    """transformers >= 5 writes Gemma 3's RoPE per layer type; the full layers' scaling and the sliding layers'
    base are read from it, and scaling the sliding layers is refused (litsft rotates them with plain RoPE)."""
    hf = dict(PUBLISHED_CONFIG_JSON["gemma-3-1b-it"])
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
        del hf[key]
    hf["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Config.from_hf_config(hf)
    assert (config.rope_theta, config.rope_local_base) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    hf["rope_parameters"]["sliding_attention"]["rope_type"] = "linear"
    with pytest.raises(LitsftError, match="rotates its sliding layers with plain RoPE only"):
        Config.from_hf_config(hf)


def test_olmo2_norms():
    for name in ("OLMo-2-0425-1B", "OLMo-2-1124-7B", "OLMo-2-1124-13B"):
        c = Config.from_name(name)
        assert not c.pre_norms and c.post_attention_norm and c.post_mlp_norm
        assert c.qk_norm and c.qk_norm_over == "all_heads" and c.rms_norm_eps == 1e-6
        assert c.max_position_embeddings == 4096


def test_phi_specific_fields():
    """Phi-3-mini-4k's window, the 128k model's and Phi-4-mini's LongRoPE (48 factors each: one per rotated pair
    of 96), Phi-4-mini's partial rotary, as their config.json files say."""
    mini_4k, mini_128k = (
        Config.from_name("Phi-3-mini-4k-instruct"),
        Config.from_name("Phi-3-mini-128k-instruct"),
    )
    assert (mini_4k.sliding_window, mini_4k.max_position_embeddings, mini_4k.rope_scaling) == (
        2047,
        4096,
        None,
    )
    assert (mini_128k.sliding_window, mini_128k.max_position_embeddings) == (262144, 131072)
    scaling = mini_128k.rope_scaling
    assert (scaling["type"], scaling["original_max_position_embeddings"]) == ("longrope", 4096)
    assert scaling["long_factor"][:2] + scaling["long_factor"][-2:] == [
        1.0700000524520874, 1.1200000047683716, 64.69000244140625, 64.76000213623047
    ]  # fmt: skip
    assert scaling["short_factor"][:4] + scaling["short_factor"][-1:] == [1.1, 1.1, 1.1, 1.3000000000000003,
                                                                           3.049999999999997]  # fmt: skip
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == 48
    phi4 = Config.from_name("phi-4")
    assert (phi4.max_position_embeddings, phi4.sliding_window, phi4.rope_scaling, phi4.eos_token_id) == (
        16384, None, None, 100265
    )  # fmt: skip
    mini4 = Config.from_name("Phi-4-mini-instruct")
    assert (mini4.rotary_fraction, mini4.rotary_dim, mini4.head_dim, mini4.sliding_window) == (
        0.75,
        96,
        128,
        262144,
    )
    assert mini4.rope_scaling["short_factor"] == [1.0] * 48
    assert mini4.rope_scaling["long_factor"][-3:] == [33.5, 44.16, 47.77]
    assert (mini4.bos_token_id, mini4.eos_token_id, mini4.max_position_embeddings) == (199999, 199999, 131072)


def test_from_name_returns_an_independent_copy():
    config = Config.from_name("Llama-3.1-8B")
    config.rope_scaling["factor"] = 1.0
    assert Config.from_name("Llama-3.1-8B-Instruct").rope_scaling["factor"] == 8.0
    assert Config.from_name("Llama-3.1-8B").rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("name", PUBLISHED)
def test_hf_config_round_trip(name):
    config = Config.from_name(name)
    hf = json.loads(json.dumps(config.to_hf_config()))  # what a config.json file holds
    assert Config.from_hf_config(hf, name=name) == config


@pytest.mark.parametrize("name", PUBLISHED)
def test_transformers_builds_the_exported_config(name):
    config = Config.from_name(name)
    hf = hf_config_object(config)
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf.model_type] == config.hf_architecture
    assert (hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads) == (
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
    )
    assert (hf.hidden_size, hf.intermediate_size, hf.vocab_size, hf.head_dim) == (
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
        config.head_dim,
    )
    # Gemma 3 has RoPE parameters per layer type: the full layers', then the sliding layers'.
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)
    assert rope["rope_theta"] == config.rope_theta
    if config.rope_local_base is not None:
        assert hf.rope_parameters["sliding_attention"]["rope_theta"] == config.rope_local_base
        assert hf.rope_parameters["sliding_attention"]["rope_type"] == "default"
        assert rope.get("factor") == (config.rope_scaling or {}).get("factor")
    if config.layer_types is not None:
        assert hf.layer_types == config.layer_types and hf.sliding_window == config.sliding_window
    assert hf.tie_word_embeddings == config.tie_word_embeddings
    assert config == Config.from_name(name)  # building the HF config did not edit ours


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_count_matches_transformers_on_a_tiny_shape(name):
    tiny = tiny_shape(Config.from_name(name))
    assert num_parameters(tiny) == meta_parameter_count(tiny)


@pytest.mark.parametrize("name", KNOWN_PARAMETER_COUNTS)
def test_parameter_count_of_well_known_models(name):
    config = Config.from_name(name)
    assert num_parameters(config) == KNOWN_PARAMETER_COUNTS[name]
    assert meta_parameter_count(config) == KNOWN_PARAMETER_COUNTS[name]


def test_unknown_name_lists_close_matches():
    with pytest.raises(LitsftError) as error:
        Config.from_name("Lama-3.1-8B")
    assert str(error.value) == (
        "unknown model name 'Lama-3.1-8B'. "
        "Did you mean one of: Llama-3.1-8B, Llama-3.1-8B-Instruct, Llama-3.1-70B, Llama-3.1-405B?"
    )
    # Names that contain what was typed (any case) come first.
    with pytest.raises(
        LitsftError, match=r"Did you mean one of: Qwen2\.5-7B, Qwen2\.5-7B-Instruct, Qwen2\.5-72B,"
    ):
        Config.from_name("qwen2.5-7b")


def test_unknown_name_without_close_matches_points_to_list_models():
    with pytest.raises(LitsftError) as error:
        Config.from_name("gpt-neox-20b")
    assert str(error.value) == "unknown model name 'gpt-neox-20b'. Run `litsft list_models` for the list."


def test_unsupported_rope_type():
    with pytest.raises(LitsftError) as error:
        Config.from_name("tiny-llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert str(error.value) == (
        "tiny-llama: rope_scaling type 'dynamic' is not supported; supported types are default, llama3, linear, "
        "yarn, longrope, su"
    )


def test_list_models_prints_names_with_parameter_counts(capsys):
    list_models()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(NAMED_CONFIGS)
    rows = {line.split()[0]: line.split()[1] for line in lines}
    assert rows["Llama-2-7b-hf"] == "6.74B"
    assert rows["Llama-2-13b-hf"] == "13.0B"
    assert rows["Llama-3.1-405B"] == "406B"
    assert rows["SmolLM2-135M"] == "135M"


@pytest.mark.parametrize(
    ("hf_changes", "expected"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, (16, 0)),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, (None, 0)),
        (
            {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 16},
            (None, 0),
        ),  # use_sliding_window false
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 16}, (16, 3)),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 16,
                "max_window_layers": 1,
                "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
            },
            (16, 1),
        ),  # fmt: skip
        (
            {"architectures": ["LlamaForCausalLM"], "use_sliding_window": True, "sliding_window": 16},
            (None, 0),
        ),
    ],
)
def test_sliding_window_is_read_as_transformers_reads_it(hf_changes, expected):
    """Mistral windows every layer; Qwen2 only with use_sliding_window, from layer max_window_layers on (or
    from the first "sliding_attention" of layer_types); Llama never."""
    hf = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_window_layers": 3, **hf_changes}  # fmt: skip
    config = Config.from_hf_config(hf)
    assert config.sliding_window == expected[0]
    windows = [config.attention_window(i) for i in range(4)]
    assert windows == [expected[0] if i >= expected[1] else None for i in range(4)]
    exported = config.to_hf_config()
    if expected[0] is not None and hf["architectures"] == ["Qwen2ForCausalLM"]:
        assert exported["use_sliding_window"] and exported["max_window_layers"] == expected[1]
    assert Config.from_hf_config(json.loads(json.dumps(exported))) == config


def test_sliding_layers_in_any_order_are_read_per_layer():
    """Gemma-style layouts (sliding layers before full ones) are read layer by layer and written back as
    layer_types, which max_window_layers cannot say."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    hf = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "use_sliding_window": True, "sliding_window": 8,
          "layer_types": layer_types}  # fmt: skip
    config = Config.from_hf_config(hf)
    assert [config.attention_window(i) for i in range(4)] == [8, None, 8, None]
    exported = config.to_hf_config()
    assert exported["layer_types"] == layer_types
    assert Config.from_hf_config(exported) == config
    assert type(hf_config_object(config)).__name__ == "Qwen2Config"


def test_layer_types_of_the_wrong_length_are_refused():
    with pytest.raises(
        LitsftError, match="layer_types must name full_attention or sliding_attention for each"
    ):
        Config.from_name("tiny-llama", sliding_window=4, layer_types=["sliding_attention"])


def test_checkpoint_configs_written_with_max_window_layers_still_load(tmp_path):
    config = Config.from_name(
        "tiny-llama", sliding_window=4, layer_types=["full_attention", "sliding_attention"]
    )
    values = dataclasses.asdict(config)
    del values["layer_types"]
    (tmp_path / "litsft_config.json").write_text(json.dumps({**values, "max_window_layers": 1}))
    assert Config.from_checkpoint(tmp_path) == config


def test_unregistered_architecture_is_refused_with_the_supported_list():
    with pytest.raises(LitsftError) as error:
        Config.from_hf_config({"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 8})
    assert str(error.value) == (
        f"unsupported architecture 'GPTNeoXForCausalLM'; litsft supports {', '.join(FAMILIES)}"
    )
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(FAMILIES)
