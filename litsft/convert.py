"""Convert checkpoints between Hugging Face and litsft, streaming one tensor at a time.

Everything is checked before anything is written (architecture, files, tensor names and shapes, read from
file headers), and the output is built in a temporary directory that is renamed at the end, so a failed
conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

import torch

from litsft.config import Config
from litsft.errors import LitsftError
from litsft.model import Transformer
from litsft.weight_files import (
    DEFAULT_MAX_SHARD_SIZE,
    atomic_output_dir,
    checkpoint_tensor_shapes,
    copy_tokenizer_files,
    iter_checkpoint_tensors,
    iter_tensors,
    save_checkpoint_files,
    tensor_infos,
    weight_file_map,
    write_safetensors,
)

DType = Literal["auto", "float32", "bfloat16", "float16"]

# litsft name -> Hugging Face name; "{i}" is the layer index. The reverse map is derived below.
HF_NAME_TEMPLATES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.q_proj.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blocks.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.k_proj.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blocks.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.v_proj.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blocks.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attn.o_proj.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blocks.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blocks.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LITSFT_NAME_TEMPLATES: dict[str, str] = {hf: litsft for litsft, hf in HF_NAME_TEMPLATES.items()}
# Old transformers versions saved RoPE's inverse frequencies; litsft recomputes them from the config.
IGNORED_HF_NAME = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _rename(name: str, templates: dict[str, str]) -> str | None:
    """Translate `name` with `templates`, or None when no template matches."""
    match = _LAYER_INDEX.search(name)
    template = _LAYER_INDEX.sub(".{i}.", name, count=1) if match else name
    target = templates.get(template)
    if target is None:
        return None
    return target.format(i=match.group(1)) if match else target


def hf_name(litsft_name: str) -> str:
    """The Hugging Face name of a litsft parameter name."""
    name = _rename(litsft_name, HF_NAME_TEMPLATES)
    if name is None:
        raise KeyError(f"no Hugging Face name for litsft parameter {litsft_name!r}")
    return name


def litsft_name(hf_name: str) -> str | None:
    """The litsft name of a Hugging Face tensor name, or None when litsft has no such parameter."""
    return _rename(hf_name, LITSFT_NAME_TEMPLATES)


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """litsft name -> shape of every tensor a checkpoint of `config` stores (a tied lm_head is not stored)."""
    with torch.device("meta"):  # shapes only: no memory, even for a 70B config
        model = Transformer(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def convert_from_hf(
    hf_dir: Path,
    out_dir: Path | None = None,
    dtype: DType = "auto",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Convert a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3) into a litsft checkpoint directory.

    Args:
        hf_dir: Directory with config.json, the weights (safetensors or .bin, single or sharded) and the
            tokenizer files.
        out_dir: Where to write the litsft checkpoint; must be absent or empty.
            Default: checkpoints/<name of hf_dir>.
        dtype: Store the weights in this dtype; "auto" keeps the dtype they have.
        max_shard_size: Split the weights into files of at most this size, e.g. 5GB, 500MB, 2GiB.
    """
    hf_dir = Path(hf_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path("checkpoints") / hf_dir.resolve().name
    convert_hf_directory(hf_dir, out_dir, dtype=dtype, max_shard_size=max_shard_size)
    print(f"Saved litsft checkpoint to {out_dir}")


def convert_hf_directory(
    hf_dir: Path,
    out_dir: Path,
    name: str | None = None,
    dtype: DType = "auto",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    extra_files: dict[str, str] | None = None,
) -> None:
    """What `convert_from_hf` does, for callers that know the model's name (a hub id; default: the directory's
    name) or add files to the checkpoint (where it came from), written before the checkpoint is published."""
    config = _read_hf_config(hf_dir, name)
    names = _check_hf_tensors(hf_dir, config)  # litsft name -> HF name
    if dtype != "auto":
        config.torch_dtype = dtype
    with atomic_output_dir(out_dir) as tmp_dir:
        tensors = ((names[hf], tensor) for hf, tensor in iter_tensors(hf_dir, names))
        save_checkpoint_files(_cast(tensors, dtype), config, tmp_dir, hf_dir, max_shard_size)
        for file_name, text in (extra_files or {}).items():
            (tmp_dir / file_name).write_text(text)


def convert_to_hf(
    checkpoint_dir: Path,
    out_dir: Path | None = None,
    dtype: DType = "auto",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    lora_format: Literal["merged", "peft"] = "merged",
) -> None:
    """Convert a litsft checkpoint directory into a Hugging Face checkpoint that transformers loads as is.

    Args:
        checkpoint_dir: A litsft checkpoint directory (litsft_config.json and model*.safetensors), or a LoRA
            checkpoint written by finetune_lora (lora_config.json and adapter.safetensors).
        out_dir: Where to write the Hugging Face checkpoint; must be absent or empty.
            Default: <checkpoint_dir>-hf next to checkpoint_dir.
        dtype: Write the weights in this dtype; "auto" keeps the dtype they have.
        max_shard_size: Split the weights into files of at most this size, e.g. 5GB, 500MB, 2GiB.
        lora_format: For a LoRA checkpoint: "merged" writes the base model with the adapters folded in,
            "peft" writes a PEFT adapter (adapter_config.json, adapter_model.safetensors) for the HF base model.
    """
    checkpoint_dir = Path(checkpoint_dir)
    out_dir = Path(out_dir) if out_dir is not None else checkpoint_dir.with_name(checkpoint_dir.name + "-hf")
    if (checkpoint_dir / "lora_config.json").is_file():
        from litsft.lora import export_lora_to_hf

        export_lora_to_hf(checkpoint_dir, out_dir, lora_format)
        print(f"Saved Hugging Face {lora_format} export of the LoRA checkpoint to {out_dir}")
        return
    config = Config.from_checkpoint(checkpoint_dir)
    _check_checkpoint_tensors(checkpoint_dir, config)
    if dtype != "auto":
        config.torch_dtype = dtype
    with atomic_output_dir(out_dir) as tmp_dir:
        tensors = _cast(iter_checkpoint_tensors(checkpoint_dir), dtype)
        write_hf_checkpoint(tensors, config, tmp_dir, checkpoint_dir, max_shard_size)
    print(f"Saved Hugging Face checkpoint to {out_dir}")


def write_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: Config,
    out_dir: Path,
    tokenizer_source_dir: Path | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write litsft-named tensors as a Hugging Face checkpoint into an existing `out_dir`: config.json,
    generation_config.json, safetensors weights in HF names, and the tokenizer files."""
    out_dir = Path(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2) + "\n")
    if tokenizer_source_dir is not None:
        copy_tokenizer_files(tokenizer_source_dir, out_dir)
    if not (out_dir / "generation_config.json").is_file():
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        generation = {key: value for key, value in generation.items() if value is not None}
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    # transformers re-ties lm_head to the embeddings itself; a stored copy would only cost disk.
    tensors = (
        (hf_name(name), tensor)
        for name, tensor in named_tensors
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    )
    write_safetensors(tensors, out_dir, max_shard_size)


def _read_hf_config(hf_dir: Path, name: str | None = None) -> Config:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise LitsftError(
            f"{hf_dir} has no config.json; point hf_dir at a Hugging Face checkpoint directory "
            "(the one with config.json and the weights)"
        )
    try:
        hf_config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise LitsftError(
            f"{path} is not valid JSON ({err}); restore it from the original checkpoint"
        ) from None
    return Config.from_hf_config(hf_config, name=name or hf_dir.resolve().name)


def _check_hf_tensors(hf_dir: Path, config: Config) -> dict[str, str]:
    """Check the HF checkpoint's tensors against `config`; returns HF name -> litsft name of those to convert."""
    infos = tensor_infos(hf_dir)
    files = weight_file_map(hf_dir)
    names: dict[str, str] = {}
    for name in infos:
        target = litsft_name(name)
        # Tied checkpoints sometimes store lm_head anyway; it is the embedding, so it is dropped.
        if IGNORED_HF_NAME.fullmatch(name) or (config.tie_word_embeddings and target == "lm_head.weight"):
            continue
        if target is None:
            raise LitsftError(
                f"{files[name]}: tensor {name!r} has no counterpart in litsft's {config.hf_architecture}; "
                "litsft converts only plain Llama/Mistral/Qwen2/Qwen3 checkpoints"
            )
        names[name] = target
    found = {target: (infos[name][0], str(files[name])) for name, target in names.items()}
    _check_shapes(found, config, str(hf_dir), hf_name)
    return names


def _check_checkpoint_tensors(checkpoint_dir: Path, config: Config) -> None:
    infos = checkpoint_tensor_shapes(checkpoint_dir)
    files = weight_file_map(checkpoint_dir)
    found = {name: (shape, str(files[name])) for name, (shape, _) in infos.items()}
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)
    _check_shapes(found, config, str(checkpoint_dir), lambda name: name)


def _check_shapes(
    found: dict[str, tuple[tuple[int, ...], str]],
    config: Config,
    directory: str,
    display_name: Callable[[str], str],
) -> None:
    """Compare found (litsft name -> (shape, file)) with what `config` requires; errors use display_name."""
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in found:
            raise LitsftError(
                f"{directory} lacks tensor {display_name(name)!r} that its config requires; "
                "the checkpoint is incomplete or its config belongs to another model"
            )
        if found[name][0] != shape:
            raise LitsftError(
                f"{found[name][1]}: tensor {display_name(name)!r} has shape {list(found[name][0])} but the "
                f"config requires {list(shape)}; the config does not match the weights, restore the original config"
            )
    for name in sorted(found.keys() - expected.keys()):
        raise LitsftError(
            f"{found[name][1]}: unexpected tensor {display_name(name)!r} that the config does not have; "
            "the config does not match the weights, restore the original config"
        )


def _cast(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: DType
) -> Iterator[tuple[str, torch.Tensor]]:
    if dtype == "auto":
        yield from named_tensors
        return
    torch_dtype = getattr(torch, dtype)
    for name, tensor in named_tensors:
        yield name, tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
