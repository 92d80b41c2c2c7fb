"""Tiny random Hugging Face checkpoints of every architecture litsft supports, built offline from a config
and saved the way the hub lays checkpoints out (config.json, weights, tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_tokenizer import write_tiny_tokenizer
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Shapes that exercise grouped-query attention in milliseconds; the vocabulary matches the tiny tokenizer.
_SHAPES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
SLIDING_WINDOW = 16
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Phi-3 128k's LongRoPE, at a scale the tests reach: sequences past 32 tokens take the long factors (one per
# rotated pair: 3/4 of 16 dimensions rotated, as Phi-4-mini rotates 3/4 of its heads).
PHI3_LONG_ROPE_LENGTH = 32
PHI3_LONG_ROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
    "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0],
}

MOE = dict(num_experts=4, num_experts_per_tok=2)
# Name -> (config, model class). Each one differs from plain Llama in what its name says.
TINY_HF_MODELS: dict[str, tuple[PretrainedConfig, type[PreTrainedModel]]] = {
    "llama": (LlamaConfig(**_SHAPES, tie_word_embeddings=False), LlamaForCausalLM),
    "llama-tied": (LlamaConfig(**_SHAPES, tie_word_embeddings=True), LlamaForCausalLM),
    "llama3-rope": (
        LlamaConfig(
            **_SHAPES, tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE_SCALING, rope_theta=500000.0
        ),
        LlamaForCausalLM,
    ),
    "mistral": (MistralConfig(**_SHAPES, tie_word_embeddings=False, sliding_window=None), MistralForCausalLM),
    # Mistral v0.1's sliding window, small enough that test sequences reach past it.
    "mistral-window": (
        MistralConfig(**_SHAPES, tie_word_embeddings=False, sliding_window=SLIDING_WINDOW),
        MistralForCausalLM,
    ),
    # Qwen2: biases on q/k/v; tied like the small Qwen2.5 models.
    "qwen2": (Qwen2Config(**_SHAPES, tie_word_embeddings=True), Qwen2ForCausalLM),
    # Qwen2 with use_sliding_window: layers from max_window_layers (here the second) on have the window.
    "qwen2-window": (
        Qwen2Config(
            **_SHAPES,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            max_window_layers=1,
        ),
        Qwen2ForCausalLM,
    ),
    # Qwen2 with the window on the first layer only: sliding layers before full ones, as Gemma 2 and 3 have.
    "qwen2-window-first": (
        Qwen2Config(
            **_SHAPES,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        Qwen2ForCausalLM,
    ),
    # Qwen3: q/k norms and a head_dim that is not hidden_size // num_heads.
    "qwen3": (Qwen3Config(**_SHAPES, head_dim=32, tie_word_embeddings=False), Qwen3ForCausalLM),
    # Gemma 2: sandwich norms, (1 + w) RMSNorm, GeGLU, scaled embeddings, a query_pre_attn_scalar other than
    # head_dim, soft-capped attention and logits (caps low enough to bite on random weights), a window on
    # even layers; tied like the published models.
    "gemma2": (
        Gemma2Config(
            **_SHAPES,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=SLIDING_WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        Gemma2ForCausalLM,
    ),
    # Gemma 3: per-head q/k norms, 2 sliding layers then a full one (5:1 in the published models), a local
    # RoPE base on the sliding layers and linearly scaled RoPE on the full ones.
    "gemma3": (
        Gemma3TextConfig(
            **{**_SHAPES, "num_hidden_layers": 3},
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=SLIDING_WINDOW,
            sliding_window_pattern=3,
            rope_theta=1000000.0,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
        Gemma3ForCausalLM,
    ),
    # OLMo 2: norms after attention and MLP only, q/k norms over the whole projection.
    "olmo2": (Olmo2Config(**_SHAPES, tie_word_embeddings=False, eos_token_id=None), Olmo2ForCausalLM),
    # Phi-3: q/k/v and gate/up fused in one tensor each; Phi-3-mini-4k's window on every layer.
    "phi3": (
        Phi3Config(**_SHAPES, sliding_window=SLIDING_WINDOW, pad_token_id=None, tie_word_embeddings=False),
        Phi3ForCausalLM,
    ),
    # Phi-4-mini: partial rotary (3/4 of each head) and LongRoPE, tied embeddings.
    "phi3-longrope": (
        Phi3Config(
            **_SHAPES,
            partial_rotary_factor=0.75,
            rope_scaling=PHI3_LONG_ROPE,
            original_max_position_embeddings=PHI3_LONG_ROPE_LENGTH,
            pad_token_id=None,
            tie_word_embeddings=True,
        ),
        Phi3ForCausalLM,
    ),
    # Granite: every multiplier away from 1, attention's from head_dim ** -0.5 (0.25), tied like the 2B model;
    # weights drawn 10 times wider than transformers' default, so that attention's scale shows in the logits.
    "granite": (
        GraniteConfig(
            **_SHAPES,
            initializer_range=0.2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.4,
            logits_scaling=3.0,
            tie_word_embeddings=True,
        ),
        GraniteForCausalLM,
    ),
    # Mixtures of experts: 4 experts, 2 per token. OLMoE: softmax then top-k, not renormalized, q/k norms over
    # the whole projection; Qwen3-MoE: renormalized, experts narrower than the dense intermediate size, per-head
    # q/k norms; Mixtral: renormalized, the hub's w1/w2/w3 names.
    "olmoe": (
        OlmoeConfig(**_SHAPES, **MOE, tie_word_embeddings=False, pad_token_id=None, eos_token_id=None),
        OlmoeForCausalLM,
    ),
    "qwen3-moe": (
        Qwen3MoeConfig(**_SHAPES, **MOE, head_dim=32, moe_intermediate_size=48, norm_topk_prob=True),
        Qwen3MoeForCausalLM,
    ),
    # Qwen2-MoE: a shared expert beside the routed ones, not renormalized, q/k/v biases; of its 3 layers the
    # second is dense (mlp_only_layers), and its window is on the first and third, by Qwen2-MoE's own rule.
    "qwen2-moe": (
        Qwen2MoeConfig(
            **{**_SHAPES, "num_hidden_layers": 3},
            **MOE,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
        ),
        Qwen2MoeForCausalLM,
    ),
    "mixtral": (
        MixtralConfig(
            **_SHAPES,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            eos_token_id=None,
        ),
        MixtralForCausalLM,
    ),
    # gpt-oss: biases everywhere, attention sinks, a window on even layers, YaRN over an original context the
    # tests pass (32 positions, factor 4), experts with a clamped SwiGLU whose clamp (2) random weights reach
    # and an alpha other than the default, the router's softmax over its top 2 logits.
    "gpt-oss": (
        GptOssConfig(
            **_SHAPES,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            swiglu_alpha=1.5,
            swiglu_limit=2.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
        GptOssForCausalLM,
    ),
}
MOE_KINDS = ("olmoe", "qwen3-moe", "qwen2-moe", "mixtral", "gpt-oss")


def tiny_hf_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A randomly initialized fp32 model of one of TINY_HF_MODELS, in eval mode. Norm weights are random too,
    so a converter that mixed up two norms would change the logits."""
    config, model_class = TINY_HF_MODELS[kind]
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):  # zero-initialized by transformers
                param.normal_(std=0.1)
            elif name.endswith("self_attn.sinks"):  # sinks that take a share of every softmax
                param.normal_(std=1.0)
            elif (
                ".experts." in name
                or ".shared_expert" in name
                or name.endswith(("mlp.gate.weight", "mlp.router.weight"))
            ):
                # Experts (Qwen2-MoE's shared one and its gate too) and routers large enough that a wrong route or
                # weight changes the logits by far more
                # than the tests' tolerance (transformers starts the routers of some families at zero).
                param.normal_(std=0.2)
    return model


def save_tiny_hf(
    model: PreTrainedModel,
    directory: Path,
    max_shard_size: str | None = None,
    bin_shards: int = 0,
    tokenizer: bool = True,
) -> Path:
    """Save `model` like a hub checkpoint: safetensors via save_pretrained (sharded past `max_shard_size`),
    or, when bin_shards > 0, as pytorch_model.bin (one shard) or pytorch_model-0000i-of-0000N.bin plus
    pytorch_model.bin.index.json. transformers 5 no longer writes .bin files, so they are written here."""
    directory = Path(directory)
    generation = None
    if tokenizer:
        write_tiny_tokenizer(directory, chat_template="chatml")
        generation = (directory / "generation_config.json").read_text()
        model.config.bos_token_id = json.loads(generation)["bos_token_id"]
        model.config.eos_token_id = json.loads(generation)["eos_token_id"]
    if bin_shards == 0:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(directory, **kwargs)
    else:
        model.config.save_pretrained(directory)
        _save_bin(model.state_dict(), directory, bin_shards)
    if generation is not None:  # save_pretrained writes its own; keep the tokenizer's stop tokens
        (directory / "generation_config.json").write_text(generation)
    return directory


def _save_bin(state_dict: dict[str, torch.Tensor], directory: Path, num_shards: int) -> None:
    names = list(state_dict)
    if num_shards == 1:
        torch.save({n: state_dict[n].clone() for n in names}, directory / "pytorch_model.bin")
        return
    weight_map = {}
    for i in range(num_shards):
        file_name = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        shard = {n: state_dict[n].clone() for n in names[i::num_shards]}
        torch.save(shard, directory / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state_dict.values())}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def assert_logits_match_transformers(
    model: torch.nn.Module, hf_model: PreTrainedModel, tokens: torch.Tensor
) -> torch.Tensor:
    """litsft's logits equal transformers' (fp32, within 1e-4) for rows of `tokens` (B, T), and for the same
    rows packed as B documents of one row; returns transformers' logits."""
    rows, length = tokens.shape
    with torch.no_grad():
        expected = hf_model(tokens).logits
        assert (model(tokens) - expected).abs().max() < 1e-4
        packed = model(tokens.view(1, -1), document_ids=torch.arange(rows).repeat_interleave(length)[None])
        assert (packed.view(rows, length, -1) - expected).abs().max() < 1e-4
    return expected
