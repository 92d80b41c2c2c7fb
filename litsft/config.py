"""Model configuration: one dataclass for every supported architecture, named configs, and the
translation to and from Hugging Face `config.json`."""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from litsft.errors import LitsftError
from litsft.storage.files import read_json

HFArchitecture = Literal["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MODEL_TYPE_OF_ARCHITECTURE: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
HF_KEYS_READ = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
        "attention_dropout",
        "sliding_window",
        "use_sliding_window",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
        "dtype",
        "mlp_bias",
        "transformers_version",
        "_name_or_path",
        "use_cache",
        "hidden_act",
        "pretraining_tp",
        "initializer_range",
    }
)
"""config.json keys `Config.from_hf_config` reads or deliberately drops; the others are kept in hf_extra."""


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
    """HF-style rope scaling, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE."""
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
    """A query attends to at most this many latest positions, itself included (Mistral v0.1, Qwen2 with
    use_sliding_window), in the layers from `max_window_layers` on; None: to the whole sequence."""
    max_window_layers: int = 0
    """With a sliding window, the layers before this index still attend to the whole sequence (Qwen2's
    max_window_layers); 0 for Mistral, whose every layer has the window."""
    hf_architecture: HFArchitecture = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    """The dtype the published weights use; written into the HF export."""
    hf_extra: dict[str, Any] = field(default_factory=dict)
    """Keys of an imported config.json that litsft does not model, written back unchanged on export."""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise LitsftError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        rope_type = (self.rope_scaling or {}).get(
            "rope_type", (self.rope_scaling or {}).get("type", "default")
        )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise LitsftError(
                f"{self.name}: rope_scaling type {rope_type!r} is not supported; "
                f"supported types are {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise LitsftError(
                f"{self.name}: sliding_window={self.sliding_window} must be at least 1 (or null for none)"
            )

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (counting from 0), or None for full causal attention."""
        return self.sliding_window if layer >= self.max_window_layers else None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer, keyed by its LoRA target name: the seven of one
        block (as litsft.model builds them) and lm_head. The one source of the parameter, FLOP and LoRA
        adapter counts (`num_parameters`, litsft.flops)."""
        C, D, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * D, self.num_kv_heads * D
        return {
            "q": (C, q), "k": (C, kv), "v": (C, kv), "o": (q, C),
            "gate": (C, inter), "up": (C, inter), "down": (inter, C),
            "lm_head": (C, self.vocab_size),
        }  # fmt: skip

    @property
    def block_linear_weights(self) -> int:
        """Weights of one block's seven linear layers (biases and norms not counted)."""
        shapes = self.linear_shapes()
        return sum(fan_in * fan_out for target, (fan_in, fan_out) in shapes.items() if target != "lm_head")

    @property
    def num_parameters(self) -> int:
        """Parameter count, tied embeddings counted once."""
        weights = self.block_linear_weights
        biases = self.head_dim * (self.num_heads + 2 * self.num_kv_heads) * self.qkv_bias
        biases += self.hidden_size * self.out_bias + 2 * self.head_dim * self.qk_norm  # qk_norm: two norms
        block = weights + biases + 2 * self.hidden_size  # two RMSNorms
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * block + embeddings + self.hidden_size

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
        values = read_json(path)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LitsftError(
                f"{path} has unknown keys {unknown}; it was written by a different litsft version"
            )
        return cls(**values)

    # ---- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any], name: str = "") -> Config:
        """Build a Config from a Hugging Face `config.json` dict of a supported architecture."""
        architectures = hf_config.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in MODEL_TYPE_OF_ARCHITECTURE:
            model_type = hf_config.get("model_type")
            by_type = {v: k for k, v in MODEL_TYPE_OF_ARCHITECTURE.items()}
            if arch is None and model_type in by_type:
                arch = by_type[model_type]
            else:
                raise LitsftError(
                    f"unsupported architecture {arch or model_type!r}; litsft supports "
                    f"{', '.join(MODEL_TYPE_OF_ARCHITECTURE)}"
                )
        if hf_config.get("mlp_bias"):
            raise LitsftError(
                "mlp_bias=true is not supported by litsft's model; use a checkpoint without MLP biases"
            )
        attention_bias = bool(hf_config.get("attention_bias", False))
        # transformers >= 5 writes `rope_parameters` (theta included); published checkpoints use
        # `rope_theta` + `rope_scaling`. Read both.
        rope_parameters = dict(hf_config.get("rope_parameters") or {})
        rope_theta = rope_parameters.pop("rope_theta", None) or hf_config.get("rope_theta", 10000.0)
        rope_scaling = hf_config.get("rope_scaling") or rope_parameters or None
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
            if rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = None
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding_window, max_window_layers = _sliding_window_of(hf_config, arch)
        # Qwen2's window layout is modelled (max_window_layers) when a window is used; kept as-is otherwise.
        window_keys = (
            {"max_window_layers", "layer_types"} if sliding_window and arch != "MistralForCausalLM" else set()
        )
        if hf_config.get("hidden_act", "silu") != "silu":
            raise LitsftError(
                f"hidden_act={hf_config['hidden_act']!r} is not supported; litsft's MLP is SwiGLU (silu)"
            )
        return cls(
            name=name or hf_config.get("_name_or_path", "") or arch,
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
            qkv_bias=is_qwen2 or attention_bias,
            out_bias=attention_bias and not is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            attention_dropout=float(hf_config.get("attention_dropout", 0.0) or 0.0),
            sliding_window=sliding_window,
            max_window_layers=max_window_layers,
            hf_architecture=arch,
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_id=hf_config.get("eos_token_id"),
            torch_dtype=str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"),
            hf_extra={k: v for k, v in hf_config.items() if k not in HF_KEYS_READ | window_keys},
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` that transformers needs to load the exported weights."""
        hf: dict[str, Any] = {
            "architectures": [self.hf_architecture],
            "model_type": MODEL_TYPE_OF_ARCHITECTURE[self.hf_architecture],
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
        if self.hf_architecture == "LlamaForCausalLM":
            hf["attention_bias"] = self.out_bias
            hf["mlp_bias"] = False
        elif self.hf_architecture == "Qwen3ForCausalLM":
            hf["attention_bias"] = False
        if self.hf_architecture in ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            hf["sliding_window"] = self.sliding_window
            if self.hf_architecture != "MistralForCausalLM":
                hf["use_sliding_window"] = self.sliding_window is not None
                if self.sliding_window is not None:
                    hf["max_window_layers"] = self.max_window_layers
        # Copies: transformers edits the dicts it is given (it adds rope_theta to rope_scaling).
        hf.update(copy.deepcopy(self.hf_extra))
        return hf


def _sliding_window_of(hf_config: dict[str, Any], arch: str) -> tuple[int | None, int]:
    """(sliding window, first windowed layer) as transformers reads them: Mistral windows every layer when
    `sliding_window` is set; Qwen2 and Qwen3 only with `use_sliding_window`, from layer `max_window_layers`
    on (28 by default), or where `layer_types` says "sliding_attention"."""
    if arch == "MistralForCausalLM":
        return hf_config.get("sliding_window"), 0
    if arch == "LlamaForCausalLM" or not hf_config.get("use_sliding_window", False):
        return None, 0
    window = hf_config.get("sliding_window")
    if window is None:
        return None, 0
    num_layers = hf_config["num_hidden_layers"]
    first = min(hf_config.get("max_window_layers", 28), num_layers)
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        windowed = [kind == "sliding_attention" for kind in layer_types]
        first = windowed.index(True) if any(windowed) else num_layers
        if windowed != [i >= first for i in range(num_layers)]:
            raise LitsftError(
                f"layer_types {layer_types} mixes full and sliding attention in an order litsft cannot "
                "model (sliding layers must come last); use a checkpoint without such layer_types"
            )
    if first >= num_layers:
        return None, 0
    return window, first


CONFIG_FILENAME = "litsft_config.json"

# ---- named configs ------------------------------------------------------------------------------
# Sources: each model's published config.json, https://huggingface.co/<org>/<name>/blob/main/config.json
# (the org is named above each family), and LitGPT's table of the same models,
# https://github.com/Lightning-AI/litgpt/blob/main/litgpt/config.py. tests/test_config.py repeats the key
# numbers in a table of its own, so a typo here fails a test.
NAMED_CONFIGS: dict[str, Config] = {}


def _register(*configs: Config) -> None:
    for config in configs:
        NAMED_CONFIGS[config.name] = config


def _model(
    name: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, **family: Any
) -> Config:
    """One published shape; `family` holds what the whole family shares (vocab, RoPE, token ids...)."""
    return Config(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        **family,
    )


def close_model_names(name: str, limit: int = 5) -> list[str]:
    """Named configs that contain `name` (any case) or nearly spell it, best first."""
    lower = {n.lower(): n for n in NAMED_CONFIGS}
    contained = [n for low, n in lower.items() if name.lower() in low]
    similar = [lower[m] for m in difflib.get_close_matches(name.lower(), list(lower), n=limit, cutoff=0.8)]
    return list(dict.fromkeys(contained + similar))[:limit]


# Tiny models for tests and the demo: shapes that exercise GQA, biases and norms in seconds on a CPU.
TINY = dict(vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0, torch_dtype="float32")
_register(
    _model("tiny-llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=176, **TINY),
    _model("demo-llama", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=352, **TINY),
)

# Llama 2: meta-llama/Llama-2-{7,13,70}b-hf and -chat-hf (the same config.json); fp16 weights.
LLAMA_2 = dict(
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
    _register(
        _model(f"Llama-2-{size}-hf", *shape, **LLAMA_2), _model(f"Llama-2-{size}-chat-hf", *shape, **LLAMA_2)
    )

# Llama 3, 3.1, 3.2 (meta-llama/Meta-Llama-3-8B, Llama-3.1-8B-Instruct, ...): 128256-token vocab, RoPE
# theta 500000. Instruct releases stop at <|eot_id|> (128009); 3.1 and 3.2 Instruct list
# [<|end_of_text|>, <|eom_id|>, <|eot_id|>] in config.json's eos_token_id.
LLAMA_3 = dict(
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
    base = _model(f"Meta-Llama-3-{size}", *shape, **LLAMA_3, max_position_embeddings=8192)
    _register(base, replace(base, name=f"Meta-Llama-3-{size}-Instruct", eos_token_id=128009))
for size, *shape in (
    ("8B", 32, 4096, 32, 8, 14336),
    ("70B", 80, 8192, 64, 8, 28672),
    ("405B", 126, 16384, 128, 8, 53248),
):
    base = _model(
        f"Llama-3.1-{size}", *shape, **LLAMA_3, max_position_embeddings=131072, rope_scaling=_llama3_rope(8.0)
    )
    _register(base, replace(base, name=f"Llama-3.1-{size}-Instruct", eos_token_id=LLAMA_3_1_INSTRUCT_EOS))
# Llama 3.2 shares the input embedding with the output head (meta-llama/Llama-3.2-1B config.json: head_dim
# 64, rope factor 32, tie_word_embeddings true).
for size, *shape in (("1B", 16, 2048, 32, 8, 8192), ("3B", 28, 3072, 24, 8, 8192)):
    base = _model(
        f"Llama-3.2-{size}",
        *shape,
        **LLAMA_3,
        max_position_embeddings=131072,
        rope_scaling=_llama3_rope(32.0),
        tie_word_embeddings=True,
    )
    _register(base, replace(base, name=f"Llama-3.2-{size}-Instruct", eos_token_id=LLAMA_3_1_INSTRUCT_EOS))

# Mistral 7B (mistralai/Mistral-7B-v0.1, -v0.3 and their -Instruct-): v0.1 attends within a 4096-token
# sliding window (RoPE theta 1e4, 32000 tokens); v0.3 has no window, theta 1e6 and 32768 tokens.
MISTRAL = dict(
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    hf_architecture="MistralForCausalLM",
)
for version, own in (
    ("v0.1", dict(vocab_size=32000, rope_theta=10000.0, sliding_window=4096)),
    ("v0.3", dict(vocab_size=32768, rope_theta=1000000.0)),
):
    for kind in ("", "Instruct-"):
        _register(_model(f"Mistral-7B-{kind}{version}", 32, 4096, 32, 8, 14336, **MISTRAL, **own))

# Qwen2.5 (Qwen/Qwen2.5-<size> and -Instruct): bias on q/k/v, theta 1e6; 0.5B-3B tie embeddings and have
# 151936 tokens, 7B+ have 152064. Base models end documents with <|endoftext|> (151643), Instruct turns with
# <|im_end|> (151645); Instruct config.json says max_position_embeddings 32768 and rms_norm_eps 1e-6 for
# every size, base 14B-72B use 1e-5 and the base context differs per size.
QWEN2_5 = dict(
    rope_theta=1000000.0,
    qkv_bias=True,
    bos_token_id=151643,
    eos_token_id=151643,
    hf_architecture="Qwen2ForCausalLM",
)
QWEN2_5_INSTRUCT = dict(eos_token_id=151645, max_position_embeddings=32768, rms_norm_eps=1e-6)
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
    base = _model(f"Qwen2.5-{size}", *shape, **QWEN2_5, **sized)
    _register(base, replace(base, name=f"Qwen2.5-{size}-Instruct", **QWEN2_5_INSTRUCT))

# Qwen3 (Qwen/Qwen3-<size>, the post-trained releases): RMSNorm on queries and keys, head_dim 128 whatever
# the width, 151936 tokens, theta 1e6, max_position_embeddings 40960; 0.6B-4B tie embeddings. The
# pretrained "-Base" releases differ in context length and eos; convert their config.json instead.
QWEN3 = dict(
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
for size, *shape, tied in (
    ("0.6B", 28, 1024, 16, 8, 3072, True),
    ("1.7B", 28, 2048, 16, 8, 6144, True),
    ("4B", 36, 2560, 32, 8, 9728, True),
    ("8B", 36, 4096, 32, 8, 12288, False),
    ("14B", 40, 5120, 40, 8, 17408, False),
    ("32B", 64, 5120, 64, 8, 25600, False),
):
    _register(_model(f"Qwen3-{size}", *shape, **QWEN3, tie_word_embeddings=tied))

# SmolLM2 (HuggingFaceTB/SmolLM2-<size>, the base models): Llama architecture, tied embeddings, 49152
# tokens, token 0 as bos and eos. The -Instruct releases use other token ids; convert their config.json.
SMOLLM2 = dict(
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
    _register(_model(f"SmolLM2-{size}", *shape, **SMOLLM2, rope_theta=theta))

# TinyLlama 1.1B: "TinyLlama-1.1B" is TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T (fp32 weights),
# the chat model TinyLlama/TinyLlama-1.1B-Chat-v1.0.
TINY_LLAMA = dict(
    vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2
)
_register(
    _model("TinyLlama-1.1B", 22, 2048, 32, 4, 5632, **TINY_LLAMA, torch_dtype="float32"),
    _model("TinyLlama-1.1B-Chat-v1.0", 22, 2048, 32, 4, 5632, **TINY_LLAMA),
)


def format_count(count: int) -> str:
    """A parameter count for people, three significant digits: 6.74B, 13.0B, 135M, 158K."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            value = count / scale
            decimals = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{decimals}f}{suffix}"
    return str(count)


def list_models() -> None:
    """Print the named model configs with their parameter counts."""
    width = max(len(name) for name in NAMED_CONFIGS)
    for name, config in NAMED_CONFIGS.items():
        print(f"{name:<{width}}  {format_count(config.num_parameters):>6}  {config.hf_architecture}")
