"""The litsft model folder: what `convert_from_hf`, `merge_lora` and every training run's final/ write, and
what training, `generate` and `convert_to_hf` read. `save_model_folder` writes it from whole tensors in one
process, `save_model_folder_from_ranks` from a model sharded across ranks; both finish it the same way.

    litsft_config.json        the model's Config (written last: a folder with it is complete)
    model*.safetensors        weights in litsft names, sharded like Hugging Face's (a tied lm_head is not stored)
    litsft_manifest.json      a fingerprint of the weights, and the Hugging Face model they came from
    tokenizer files           tokenizer.json and the side files Hugging Face keeps next to it (TOKENIZER_FILES)

The fingerprint (SHA-256 over every stored tensor's name, dtype, shape and bytes) is computed while the
weights are written, so it costs no extra read; a LoRA run records its base's fingerprint to refuse merging
its adapters onto weights that changed since.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from litsft.checkpoint.checkpoint_dirs import VALIDATION_PROMPTS_FILE
from litsft.checkpoint.sharded_tensors import (
    ShardedReader,
    barrier,
    global_rank,
    persistent_buffers,
    plain,
    save_consolidated,
)
from litsft.checkpoint.weight_files import (
    DEFAULT_MAX_SHARD_SIZE,
    SAFETENSORS_INDEX_NAME,
    SAFETENSORS_NAME,
    TensorInfo,
    iter_tensors,
    remove_saved_weights,
    shard_numbers,
    tensor_infos,
    write_safetensors,
)
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.precision.quantization import is_nf4, load_nf4_weight
from litsft.runtime.faults import fault_point
from litsft.runtime.files import read_json, write_json

MANIFEST_NAME = "litsft_manifest.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    # Side files: litsft reads tokenizer.json only, but Hugging Face tools read these next to it.
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


class WeightsFingerprint:
    """SHA-256 over (name, dtype, shape, bytes) of each tensor, independent of the order they come in."""

    def __init__(self) -> None:
        self.digests: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(memoryview(data))
        self.digests[name] = digest.hexdigest()

    def passing(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`named_tensors` unchanged, each added to the fingerprint on its way through."""
        for name, tensor in named_tensors:
            self.add(name, tensor)
            yield name, tensor

    def hexdigest(self) -> str:
        lines = "".join(f"{name} {digest}\n" for name, digest in sorted(self.digests.items()))
        return hashlib.sha256(lines.encode()).hexdigest()


# ---- writing --------------------------------------------------------------------------------------------
def save_model_folder(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: Config,
    out_dir: Path,
    tokenizer_source_dir: Path | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    hf_source: str | None = None,
) -> None:
    """Write a litsft model folder: weights (streamed, sharded past `max_shard_size`), manifest, the tokenizer
    files of `tokenizer_source_dir`, config. A tied `lm_head.weight` is skipped: loading restores it from
    `embed.weight`. Weights saved earlier in `out_dir` are replaced. `hf_source` is the Hugging Face model
    the weights came from (a hub id or a local directory), recorded for PEFT exports."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.tie_word_embeddings:
        named_tensors = ((n, t) for n, t in named_tensors if n != "lm_head.weight")
    fingerprint = WeightsFingerprint()
    write_safetensors(fingerprint.passing(named_tensors), out_dir, max_shard_size)
    _finish_model_folder(out_dir, fingerprint.hexdigest(), config, tokenizer_source_dir, hf_source)


def _finish_model_folder(
    out_dir: Path, fingerprint: str, config: Config, tokenizer_source_dir: Path | None, hf_source: str | None
) -> None:
    """Everything but the weights: manifest, tokenizer files, and the config last."""
    write_json(out_dir / MANIFEST_NAME, {"weights_sha256": fingerprint, "hf_source": hf_source})
    if tokenizer_source_dir is not None:
        copy_tokenizer_files(tokenizer_source_dir, out_dir)
    # Config last: a directory with litsft_config.json is a finished model folder.
    config.save(out_dir)


def copy_tokenizer_files(source_dir: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files present in `source_dir` (see TOKENIZER_FILES); returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        source = Path(source_dir) / name
        if source.is_file() and source.resolve() != (Path(out_dir) / name).resolve():
            shutil.copyfile(source, Path(out_dir) / name)
            copied.append(name)
    return copied


def save_model_folder_from_ranks(
    model: nn.Module,
    out_dir: Path,
    config: Config,
    tokenizer_dir: Path | None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write a model sharded across ranks (any placement) as a litsft model folder, its weights cast to the
    config's dtype. Every rank writes its own parts; rank 0 merges them into whole tensors one at a time
    (`save_consolidated`) and finishes the folder. No rank holds the model whole: rank 0's peak is its own
    parts plus one whole tensor (benchmarks/bench_final_folder_memory.py measures it against gathering every
    tensor to rank 0). Collective."""
    out_dir = Path(out_dir)
    dtype = getattr(torch, config.torch_dtype)
    buffers = persistent_buffers(
        model
    )  # kept in their own dtype: a balancing bias moves in steps bf16 rounds
    tensors = {
        name: plain(tensor).detach().to(dtype)
        if tensor.is_floating_point() and name not in buffers
        else tensor.detach()
        for name, tensor in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    rank = global_rank()
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_saved_weights(out_dir)
    barrier()
    sizes = ((name, tensor.numel() * tensor.element_size()) for name, tensor in tensors.items())
    file_numbers = shard_numbers(sizes, max_shard_size)
    save_consolidated(tensors, out_dir, file_numbers, before_write=lambda: fault_point("final_writing", rank))
    if rank == 0:
        if max(file_numbers.values(), default=1) == 1:  # one file: named as Hugging Face names a single one
            (out_dir / "model-00001-of-00001.safetensors").rename(out_dir / SAFETENSORS_NAME)
            (out_dir / SAFETENSORS_INDEX_NAME).unlink()
        fingerprint = WeightsFingerprint()
        for name in tensors:  # read back one at a time, each file opened per tensor: never mapped whole
            fingerprint.add(*next(iter_tensors(out_dir, [name])))
        _finish_model_folder(out_dir, fingerprint.hexdigest(), config, tokenizer_dir, hf_source=None)
    barrier()


# ---- reading --------------------------------------------------------------------------------------------
def model_tensor_shapes(model_dir: Path) -> dict[str, TensorInfo]:
    """Name -> (shape, dtype) of the tensors stored in a litsft model folder, from the file headers only."""
    Config.from_checkpoint(model_dir)  # a clear error for a directory that is not a litsft model folder
    return tensor_infos(model_dir)


def iter_model_tensors(
    model_dir: Path, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the stored (name, tensor) pairs of a litsft model folder one at a time, e.g. to fill a model
    built on the meta device shard by shard. A tied `lm_head.weight` is not stored and not yielded."""
    Config.from_checkpoint(model_dir)
    yield from iter_tensors(model_dir, names)


def load_model_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The full state dict of a litsft model folder, ready for `Transformer(config).load_state_dict(sd)`.
    With tied embeddings `lm_head.weight` is added as the same tensor as `embed.weight`, as
    `Transformer.state_dict()` has it."""
    config = Config.from_checkpoint(model_dir)
    state_dict = dict(iter_tensors(model_dir))
    if config.tie_word_embeddings and "embed.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["embed.weight"]
    return state_dict


def write_validation_prompts(model_dir: Path, conversations: list[list[dict[str, str]]]) -> None:
    """Keep a training run's first validation conversations (up to their first reply) in its model folder:
    the prompts `convert_to_hf --check` asks the export. Nothing is written for none."""
    if conversations:
        write_json(model_dir / VALIDATION_PROMPTS_FILE, conversations)


def read_manifest(model_dir: Path) -> dict[str, Any]:
    """The folder's manifest; empty for folders written before litsft kept one."""
    path = Path(model_dir) / MANIFEST_NAME
    return read_json(path) if path.is_file() else {}


def weights_fingerprint(model_dir: Path) -> str:
    """The fingerprint of a model folder's weights: recorded in its manifest, else computed by reading them."""
    recorded = read_manifest(model_dir).get("weights_sha256")
    if isinstance(recorded, str):
        return recorded
    fingerprint = WeightsFingerprint()
    for name, tensor in iter_model_tensors(model_dir):
        fingerprint.add(name, tensor)
    return fingerprint.hexdigest()


def fingerprint_of_state_dict(state_dict: dict[str, torch.Tensor], config: Config) -> str:
    """The fingerprint `save_model_folder` records for these tensors (a tied lm_head is not stored)."""
    fingerprint = WeightsFingerprint()
    for name, tensor in state_dict.items():
        if not (config.tie_word_embeddings and name == "lm_head.weight"):
            fingerprint.add(name, tensor)
    return fingerprint.hexdigest()


@torch.no_grad()
def load_model_weights(
    model: nn.Module, model_dir: Path, stored_name: Callable[[str], str | None] = lambda name: name
) -> None:
    """Fill `model` (materialized, possibly sharded in any placement) from a litsft model folder, each rank
    reading only its own part of each tensor. `stored_name` maps a parameter name to its name on disk, or
    None for one not loaded (LoRA's adapters; its frozen `...q_proj.base.weight` is stored as
    `...q_proj.weight`). Each rank reads on its own (the folder holds whole tensors): nothing collective."""
    # Its checks first: not a model folder, weights that are not safetensors (a pickle is refused unread),
    # a dtype litsft does not read, a damaged header: one line each, naming the file.
    model_tensor_shapes(model_dir)
    reader = ShardedReader(model_dir, fix="convert the model again")
    stored = reader.stored()
    targets, nf4_weights, missing = {}, {}, []
    for name, param in list(model.named_parameters()):  # a tied lm_head is the embedding, listed once
        name_on_disk = stored_name(name)
        if name_on_disk is None:
            continue
        if name_on_disk not in stored:
            missing.append(name_on_disk)
        elif is_nf4(param):
            nf4_weights[name] = name_on_disk
        else:
            targets[name_on_disk] = param.data
    if missing:
        raise LitsftError(
            f"{model_dir} lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}; "
            "it was converted from a different model"
        )
    # Buffers the folder holds (a mixture of experts' balancing biases, trained with them); one it lacks keeps
    # the initial value the model gave it (a folder written without them: converted from Hugging Face).
    targets.update({name: buffer for name, buffer in persistent_buffers(model).items() if name in stored})
    reader.load(targets, collective=False)
    for name, name_on_disk in nf4_weights.items():
        # Quantized whole, then split into this rank's part (litsft.model.precision.quantization): read one at a time.
        shape, dtype = stored[name_on_disk]
        full = torch.empty(shape, dtype=dtype)
        reader.load({name_on_disk: full}, collective=False)
        load_nf4_weight(model.get_submodule(name.rpartition(".")[0]), full)
