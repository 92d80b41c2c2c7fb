"""Model configuration: one dataclass for every supported architecture, named configs, and the
translation to and from Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from litsft.errors import LitsftError

HFArchitecture = Literal["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MODEL_TYPE_OF_ARCHITECTURE: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


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
    """Kept for the HF export (Mistral v0.1). Training attends to the whole sequence."""
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

    @property
    def num_parameters(self) -> int:
        """Parameter count, tied embeddings counted once."""
        attn = self.hidden_size * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads) * self.qkv_bias
        attn += self.hidden_size * self.out_bias + 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.hidden_size * self.intermediate_size
        block = attn + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * block + embeddings + self.hidden_size

    # ---- named configs -------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> Config:
        if name not in NAMED_CONFIGS:
            close = [n for n in NAMED_CONFIGS if name.lower() in n.lower()][:8]
            hint = (
                f" Did you mean one of: {', '.join(close)}?"
                if close
                else " Run `litsft list_models` for the list."
            )
            raise LitsftError(f"unknown model name {name!r}.{hint}")
        return replace(NAMED_CONFIGS[name], **overrides)

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
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise LitsftError(
                f"{path} is not valid JSON ({err}); restore it from the original checkpoint"
            ) from None
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
        use_sliding = hf_config.get("use_sliding_window", arch == "MistralForCausalLM")
        consumed = {
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
            sliding_window=hf_config.get("sliding_window") if use_sliding else None,
            hf_architecture=arch,
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_id=hf_config.get("eos_token_id"),
            torch_dtype=str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"),
            hf_extra={k: v for k, v in hf_config.items() if k not in consumed},
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
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": self.attention_dropout,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
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
        hf.update(self.hf_extra)
        return hf


CONFIG_FILENAME = "litsft_config.json"

# Named configs. Values follow each model's published config.json; tests/test_config.py holds the key
# numbers so a typo here fails a test.
NAMED_CONFIGS: dict[str, Config] = {}


def _register(*configs: Config) -> None:
    for config in configs:
        NAMED_CONFIGS[config.name] = config


_register(
    # Tiny models for tests and the demo: shapes that exercise GQA, biases and norms in seconds on a CPU.
    Config(
        name="tiny-llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        torch_dtype="float32",
    ),
    Config(
        name="demo-llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        torch_dtype="float32",
    ),
)
