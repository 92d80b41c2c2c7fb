"""Model configuration: one dataclass for every supported family, the named configs the families register,
and the translation to and from Hugging Face `config.json` (the shared keys here, each family's own in
litsft.model.families)."""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from litsft.errors import LitsftError
from litsft.model.families import FAMILIES, family_of, family_of_hf_config
from litsft.model.families.spec import LONG_ROPE_TYPES, SHARED_HF_KEYS
from litsft.runtime.files import read_json

DType = Literal["auto", "float32", "bfloat16", "float16"]
"""The dtype a conversion stores the weights in; "auto" keeps theirs."""
LayerType = Literal["full_attention", "sliding_attention"]
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", *LONG_ROPE_TYPES)
POSITIVE_FIELDS = (
    "query_pre_attn_scalar",
    "softcap_attention",
    "softcap_final",
    "rope_local_base",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)
"""Scales and caps: a value that is not positive (or, where allowed, null) is refused."""


@dataclass
class Config:
    """Shape and numerics of one decoder-only transformer (Llama and its relatives)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    """Per-head width; 0 means hidden_size // num_heads. Qwen3 sets it explicitly."""
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """HF-style rope scaling, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE. LongRoPE
    ({"type": "longrope", "short_factor": [...], "long_factor": [...], "original_max_position_embeddings": n})
    rotates a sequence of up to n tokens with the short factors, a longer one with the long factors."""
    rotary_fraction: float = 1.0
    """The share of each head's dimensions RoPE rotates, the first ones (transformers' partial_rotary_factor;
    Phi-4-mini: 0.75); the rest pass through unrotated."""
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2, Qwen2.5)."""
    out_bias: bool = False
    """Bias on the attention output projection (Llama with attention_bias=true)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys before RoPE (Qwen3)."""
    attention_dropout: float = 0.0
    sliding_window: int | None = None
    """In a "sliding_attention" layer a query attends to at most this many latest positions, itself included
    (Mistral v0.1, Qwen2 with use_sliding_window); None: every layer attends to the whole sequence."""
    layer_types: list[LayerType] | None = None
    """Each layer's attention, as transformers' `layer_types` names it; None: every layer alike (sliding when
    `sliding_window` is set). Read per layer by `attention_window`."""
    # ---- Gemma 2 / Gemma 3 / OLMo 2 block features (each off by default) ----
    rope_local_base: float | None = None
    """RoPE base of the "sliding_attention" layers, which then rotate without `rope_scaling` (Gemma 3's
    rope_local_base_freq); None: every layer uses `rope_theta` and `rope_scaling`."""
    qk_norm_over: Literal["head", "all_heads"] = "head"
    """What `qk_norm` normalizes: each head's D values (Qwen3, Gemma 3) or the whole projection, all heads
    at once, before it is split into heads (OLMo 2)."""
    pre_norms: bool = True
    """RMSNorm before attention and before the MLP; OLMo 2 has none, only the post-norms."""
    post_attention_norm: bool = False
    """RMSNorm on the attention output before it is added to the residual stream (Gemma 2/3, OLMo 2)."""
    post_mlp_norm: bool = False
    """RMSNorm on the MLP output before it is added to the residual stream (Gemma 2/3, OLMo 2)."""
    norm_unit_offset: bool = False
    """Gemma's RMSNorm: scale by (1 + weight), computed in fp32 before the cast; weights start at zero."""
    scale_embeddings: bool = False
    """Multiply the embeddings by sqrt(hidden_size), rounded to the embedding dtype as transformers does
    (Gemma)."""
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    """The gated MLP's activation: SwiGLU (silu) or GeGLU with tanh-approximated GELU (Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5."""
    softcap_attention: float | None = None
    """Attention logits are capped to c * tanh(score / c) before the softmax (Gemma 2)."""
    softcap_final: float | None = None
    """Output logits are capped to c * tanh(logit / c) (Gemma 2)."""
    attention_sinks: bool = False
    """A learned logit per query head (`attn.sinks`) joins every attention softmax's denominator and adds no
    value, so a query can attend to nothing (gpt-oss)."""
    # ---- Granite's multipliers (each off by default) ----
    embedding_multiplier: float = 1.0
    """The embeddings are multiplied by this (Granite)."""
    residual_multiplier: float = 1.0
    """Each block's attention and MLP outputs are multiplied by this before they join the residual stream
    (Granite)."""
    attention_multiplier: float | None = None
    """What attention multiplies its scores by (Granite); None: `query_pre_attn_scalar` ** -0.5, or the
    kernels' head_dim ** -0.5."""
    logits_scaling: float = 1.0
    """Output logits are divided by this, before any soft-cap (Granite; litsft.model.network.loss.output_logits)."""
    # ---- mixture of experts (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral; off by default) ----
    num_experts: int = 0
    """Routed experts in each block's MLP (litsft.model.network.moe); 0: a dense MLP."""
    experts_per_token: int = 0
    """How many experts each token is routed to (transformers' num_experts_per_tok)."""
    expert_intermediate_size: int = 0
    """Each expert's intermediate size (Qwen3-MoE's moe_intermediate_size); 0: `intermediate_size`."""
    normalize_expert_weights: bool = False
    """Rescale a token's k router probabilities to sum to 1 (norm_topk_prob; Mixtral always does)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss added to the training loss (the family's config.json value)."""
    shared_expert_intermediate_size: int = 0
    """The intermediate size of a shared expert, a SwiGLU MLP every token of an MoE layer runs beside its routed
    experts, its output scaled by sigmoid(`shared_expert_gate`) (Qwen2-MoE); 0: none."""
    sparse_step: int = 1
    """Layer i (counting from 0) routes its MLP when (i + 1) is a multiple of this and i is not in `dense_layers`
    (Qwen2-MoE's decoder_sparse_step); the others have a dense MLP of `intermediate_size`."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers whose MLP is dense whatever `sparse_step` says (Qwen2-MoE's mlp_only_layers)."""
    router_bias: bool = False
    """A bias on the router's logits (gpt-oss)."""
    router_softmax: Literal["all_experts", "top_k"] = "all_experts"
    """The router's weights: a softmax over all E logits, then the top k (OLMoE, Qwen3-MoE, Mixtral), or a
    softmax over the top k logits alone (gpt-oss)."""
    expert_bias: bool = False
    """Biases on each expert's gate/up and down projections (gpt-oss)."""
    expert_activation: Literal["silu", "clamped_swiglu"] = "silu"
    """The experts' gated activation: SwiGLU, or gpt-oss's clamped SwiGLU, (up + 1) * gate *
    sigmoid(swiglu_alpha * gate) with the gate clamped to at most `swiglu_limit` and up to [-limit, limit]."""
    swiglu_alpha: float = 1.702
    """The clamped SwiGLU's sigmoid gain (read with expert_activation="clamped_swiglu" only)."""
    swiglu_limit: float = 7.0
    """The clamped SwiGLU's clamp (read with expert_activation="clamped_swiglu" only)."""
    router_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing (https://arxiv.org/abs/2412.19437, section 2.1.2): each
    router carries a per-expert bias (`balancing_bias`, a buffer saved with the weights) added to its
    probabilities for the top-k choice only, not to the weights, and moved by this much after each optimizer
    step, up for an expert below the mean load, down above it. 0: off, no bias (what transformers' families
    have)."""
    # ----
    hf_architecture: str = "LlamaForCausalLM"
    """The config.json architecture, which names the family (litsft.model.families) that builds and converts it."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    """The dtype the published weights use; written into the HF export."""
    hf_extra: dict[str, Any] = field(default_factory=dict)
    """Keys of an imported config.json that litsft does not translate (litsft.model.families.spec.Family's
    `hf_keys_ignored`, and keys no family knows) and that the export would not write with the same value: written
    back unchanged on export."""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise LitsftError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise LitsftError(
                f"{self.name}: rope_scaling type {self.rope_type!r} is not supported; "
                f"supported types are {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self._check_rotary()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise LitsftError(
                f"{self.name}: sliding_window={self.sliding_window} must be at least 1 (or null for none)"
            )
        for key in POSITIVE_FIELDS:
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise LitsftError(f"{self.name}: {key}={value} must be positive (or null for none)")
        self._check_experts()
        family_of(self.hf_architecture)  # refuses an architecture no family registered
        self._normalize_layer_types()

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE rotates."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    def _check_rotary(self) -> None:
        if not 0 < self.rotary_fraction <= 1 or self.rotary_dim % 2:
            raise LitsftError(
                f"{self.name}: rotary_fraction={self.rotary_fraction} must rotate an even number of each head's "
                f"{self.head_dim} dimensions (0 < fraction <= 1)"
            )
        scaling = self.rope_scaling or {}
        if self.rope_type == "yarn" and "original_max_position_embeddings" not in scaling:
            raise LitsftError(
                f"{self.name}: YaRN needs original_max_position_embeddings, the context length it stretches"
            )
        if self.rope_type not in LONG_ROPE_TYPES:
            return
        for key in ("short_factor", "long_factor"):
            if len(scaling.get(key) or ()) != self.rotary_dim // 2:
                raise LitsftError(
                    f"{self.name}: LongRoPE's {key} must hold one factor per rotated pair of dimensions, "
                    f"{self.rotary_dim // 2}; got {len(scaling.get(key) or ())}"
                )
        if "original_max_position_embeddings" not in scaling:
            raise LitsftError(
                f"{self.name}: LongRoPE needs original_max_position_embeddings, the length past which the long "
                "factors apply"
            )

    @property
    def expert_intermediate(self) -> int:
        """Each expert's intermediate size."""
        return self.expert_intermediate_size or self.intermediate_size

    def routes_experts(self, layer: int) -> bool:
        """Whether layer `layer` (counting from 0) has a mixture of experts for its MLP, as transformers'
        Qwen2MoeDecoderLayer decides."""
        return self.num_experts > 0 and (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers

    def _check_experts(self) -> None:
        if not self.num_experts:
            return
        if self.sparse_step < 1:
            raise LitsftError(
                f"{self.name}: sparse_step={self.sparse_step} must be at least 1 (1: every layer routes its MLP)"
            )
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise LitsftError(
                f"{self.name}: experts_per_token={self.experts_per_token} must be between 1 and "
                f"num_experts={self.num_experts}"
            )
        for name in ("router_aux_loss_coef", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise LitsftError(f"{self.name}: {name}={getattr(self, name)} must be 0 (off) or positive")

    def _normalize_layer_types(self) -> None:
        """One spelling per layout, so that equal models compare equal: uniform layers as None."""
        if self.layer_types is None:
            return
        self.layer_types = list(self.layer_types)
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown or len(self.layer_types) != self.num_layers:
            raise LitsftError(
                f"{self.name}: layer_types must name full_attention or sliding_attention for each of the "
                f"{self.num_layers} layers; got {self.layer_types}"
            )
        if self.sliding_window is None or "sliding_attention" not in self.layer_types:
            self.sliding_window, self.layer_types = None, None
        elif "full_attention" not in self.layer_types:
            self.layer_types = None

    def attention_scale(self) -> float | None:
        """What attention multiplies its scores by; None: the kernels' default, head_dim ** -0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with `rope_local_base` (a sliding layer of Gemma 3)."""
        return self.rope_local_base is not None and self.attention_window(layer) is not None

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (counting from 0), or None for full causal attention."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    # ---- named configs -------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> Config:
        if name not in NAMED_CONFIGS:
            close = close_model_names(name)
            hint = (
                f" Did you mean one of: {', '.join(close)}?"
                if close
                else " Run `litsft list_models` for the list."
            )
            raise LitsftError(f"unknown model name {name!r}.{hint}")
        # A deep copy: the registry's dicts and lists (rope_scaling, eos ids) must not be shared with callers.
        return replace(copy.deepcopy(NAMED_CONFIGS[name]), **overrides)

    # ---- litsft checkpoint dirs ---------------------------------------------------------------
    def save(self, checkpoint_dir: Path | str) -> None:
        path = Path(checkpoint_dir) / CONFIG_FILENAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path | str) -> Config:
        path = Path(checkpoint_dir) / CONFIG_FILENAME
        if not path.is_file():
            raise LitsftError(
                f"{checkpoint_dir} is not a litsft checkpoint: {CONFIG_FILENAME} is missing. "
                "Convert a Hugging Face checkpoint first with `litsft convert_from_hf <hf_dir> --out_dir <dir>`"
            )
        return cls.from_values(read_json(path), path)

    @classmethod
    def from_values(cls, values: dict[str, Any], source: Path | str) -> Config:
        """A Config from the values `save` writes (also recorded in a step checkpoint's trainer_state.json);
        `source` names where they were read, for the error on keys this version does not know."""
        values = dict(values)
        if "max_window_layers" in values:  # written before layer_types: the windowed layers came last
            first = values.pop("max_window_layers")
            values["layer_types"] = [
                "sliding_attention" if i >= first else "full_attention" for i in range(values["num_layers"])
            ]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LitsftError(
                f"{source} has unknown keys {unknown}; it was written by a different litsft version"
            )
        return cls(**values)

    # ---- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any], name: str = "") -> Config:
        """Build a Config from a Hugging Face `config.json` dict of a registered family: the keys every family
        shares are read here, the family reads its own (litsft.model.families)."""
        family = family_of_hf_config(hf_config)
        family.refuse_unsupported(hf_config)
        own = family.config_from_hf(hf_config)
        # transformers >= 5 writes `rope_parameters` (theta included); published checkpoints use
        # `rope_theta` + `rope_scaling`. Read both.
        rope_parameters = dict(hf_config.get("rope_parameters") or {})
        rope_theta = rope_parameters.pop("rope_theta", None) or hf_config.get("rope_theta", 10000.0)
        rope_scaling = hf_config.get("rope_scaling") or rope_parameters or None
        if rope_scaling is not None:
            # transformers >= 5 also files partial_rotary_factor there; families that have it read it themselves.
            rope_scaling = {
                k: v for k, v in rope_scaling.items() if k not in ("rope_theta", "partial_rotary_factor")
            }
            if rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = None
        shared: dict[str, Any] = dict(
            name=name or hf_config.get("_name_or_path", "") or family.architecture,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hf_config["hidden_size"],
            intermediate_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_heads=hf_config["num_attention_heads"],
            num_kv_heads=hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"],
            head_dim=hf_config.get("head_dim") or 0,
            max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_dropout=float(hf_config.get("attention_dropout", 0.0) or 0.0),
            hf_architecture=family.architecture,
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_id=hf_config.get("eos_token_id"),
            torch_dtype=str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"),
        )
        config = cls(**shared | own)
        # What the export would not write by itself: the keys litsft does not translate, unless the export
        # writes them with the same value (a fresh config.json then reads back with no hf_extra).
        exported = config.to_hf_config()
        config.hf_extra = {
            key: value
            for key, value in hf_config.items()
            if key not in SHARED_HF_KEYS | family.hf_keys_read
            and (key not in exported or exported[key] != value)
        }
        return config

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` that transformers needs to load the exported weights."""
        family = family_of(self.hf_architecture)
        hf: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": self.attention_dropout,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": copy.deepcopy(self.eos_token_id),
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
        }
        hf.update(family.hf_from_config(self))
        # Copies: transformers edits the dicts it is given (it adds rope_theta to rope_scaling).
        hf.update(copy.deepcopy(self.hf_extra))
        return hf


CONFIG_FILENAME = "litsft_config.json"

# ---- named configs: registered by each family (litsft.model.families), with their sources --------------------
NAMED_CONFIGS: dict[str, Config] = {
    name: Config(**values) for family in FAMILIES.values() for name, values in family.named_configs.items()
}


def close_model_names(name: str, limit: int = 5) -> list[str]:
    """Named configs that contain `name` (any case) or nearly spell it, best first."""
    lower = {n.lower(): n for n in NAMED_CONFIGS}
    contained = [n for low, n in lower.items() if name.lower() in low]
    similar = [lower[m] for m in difflib.get_close_matches(name.lower(), list(lower), n=limit, cutoff=0.8)]
    return list(dict.fromkeys(contained + similar))[:limit]


def format_count(count: int) -> str:
    """A parameter count for people, three significant digits: 6.74B, 13.0B, 135M, 158K."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            value = count / scale
            decimals = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{decimals}f}{suffix}"
    return str(count)
