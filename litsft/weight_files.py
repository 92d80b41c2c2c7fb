"""Reading and writing weight files one tensor at a time, so that converting or loading a 70B model never
needs two full copies of it in memory.

Reads Hugging Face layouts (`model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
`pytorch_model.bin`, sharded `.bin` with `pytorch_model.bin.index.json`) and writes safetensors shards named
the way Hugging Face names them. A litsft checkpoint directory is `litsft_config.json`, weights in litsft
names in that same safetensors layout (a tied `lm_head.weight` is not stored), and the tokenizer files.
"""

from __future__ import annotations

import json
import pickle
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from litsft.config import Config
from litsft.errors import LitsftError

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
DEFAULT_MAX_SHARD_SIZE = "5GB"
# transformers refuses safetensors files whose metadata lacks {"format": "pt"}.
SAFETENSORS_METADATA = {"format": "pt"}

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SHARD_NAME = re.compile(r"model-\d{5}(-of-\d{5}\.safetensors|\.safetensors\.partial)")

TensorInfo = tuple[tuple[int, ...], torch.dtype]


def parse_size(size: str | int) -> int:
    """Bytes in a size such as 5000000, "500MB" or "2GiB" (decimal units like Hugging Face's, binary with i)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if not match:
        raise LitsftError(f"max_shard_size={size!r} is not a size; write it like 5GB, 500MB, 2GiB or 1000000")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])


# ---- writing -------------------------------------------------------------------------------------------
class ShardedSafetensorsWriter:
    """Writes (name, tensor) pairs into safetensors shards of at most `max_shard_size` bytes each (a single
    larger tensor gets a shard of its own), holding only the current shard's tensors in memory.

    One shard is written as `model.safetensors`; more as `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`. N is known only at the end, so shards are written under temporary names
    and renamed by `close()`.
    """

    def __init__(self, out_dir: Path, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = parse_size(max_shard_size)
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []  # (temporary file, tensor names) per shard
        self.names: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor {name!r} was written twice")
        self.names.add(name)
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share storage (a view of a larger tensor); copy those.
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        if self.shard and self.shard_bytes + tensor.nbytes > self.max_shard_bytes:
            self.flush()
        self.shard[name] = tensor
        self.shard_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def flush(self) -> None:
        if not self.shard:
            return
        path = self.out_dir / f"model-{len(self.written) + 1:05d}.safetensors.partial"
        save_file(self.shard, path, metadata=SAFETENSORS_METADATA)
        self.written.append((path, list(self.shard)))
        self.shard, self.shard_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give the shards their final names and write the index; returns the files."""
        self.flush()
        if len(self.written) <= 1:
            final = self.out_dir / SAFETENSORS_NAME
            if self.written:
                self.written[0][0].rename(final)
            else:  # no tensors at all: still a valid, empty file
                save_file({}, final, metadata=SAFETENSORS_METADATA)
            return [final]
        count = len(self.written)
        weight_map: dict[str, str] = {}
        files = []
        for i, (path, names) in enumerate(self.written, start=1):
            final = self.out_dir / f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return files


def write_safetensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Stream tensors into (possibly sharded) safetensors files in `out_dir`; returns the files written."""
    _remove_saved_weights(Path(out_dir))
    writer = ShardedSafetensorsWriter(out_dir, max_shard_size)
    for name, tensor in named_tensors:
        writer.add(name, tensor)
    return writer.close()


def _remove_saved_weights(directory: Path) -> None:
    """Delete weights an earlier save left in `directory`, so old shards cannot mix with new ones."""
    for path in directory.glob("model*.safetensors*"):
        if path.name in (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME) or _SHARD_NAME.fullmatch(path.name):
            path.unlink()


def copy_tokenizer_files(source_dir: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files present in `source_dir` (see TOKENIZER_FILES); returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        source = Path(source_dir) / name
        if source.is_file() and source.resolve() != (Path(out_dir) / name).resolve():
            shutil.copyfile(source, Path(out_dir) / name)
            copied.append(name)
    return copied


@contextmanager
def atomic_output_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary directory next to `out_dir` that becomes `out_dir` when the block succeeds and is deleted
    when it fails, so a failed write leaves nothing behind. Refuses an existing non-empty `out_dir`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise LitsftError(
            f"output directory {out_dir} already exists and is not empty; choose another --out_dir or remove it"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 permissions would become the checkpoint's.
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(4)}"
    tmp_dir.mkdir()
    try:
        yield tmp_dir
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        tmp_dir.rename(out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)


# ---- reading -------------------------------------------------------------------------------------------
def weight_file_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, for a directory in any of the layouts above. Checks that every file
    an index names exists, so a missing shard is reported before anything is read or written."""
    directory = Path(directory)
    for index_name in (SAFETENSORS_INDEX_NAME, BIN_INDEX_NAME):
        index_path = directory / index_name
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise LitsftError(
                    f"{index_path} is not a weights index (no valid 'weight_map': {err}); restore it from the original checkpoint"
                ) from None
            files = {name: directory / file for name, file in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.is_file():
                    raise LitsftError(
                        f"{path.name} is listed in {index_path} but missing from {directory}; "
                        "copy the complete checkpoint (all shards)"
                    )
            return files
    for file_name in (SAFETENSORS_NAME, BIN_NAME):
        path = directory / file_name
        if path.is_file():
            return dict.fromkeys(_read_names(path), path)
    raise LitsftError(
        f"no weights in {directory}: expected {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME}, {BIN_NAME} or "
        f"{BIN_INDEX_NAME}"
    )


def tensor_infos(directory: Path) -> dict[str, TensorInfo]:
    """Name -> (shape, dtype) of every tensor in `directory`, read from file headers (safetensors) or
    memory-mapped (.bin), without loading the weights."""
    infos: dict[str, TensorInfo] = {}
    for path, names in _group_by_file(weight_file_map(directory)).items():
        if path.suffix == ".safetensors":
            with _open_safetensors(path) as f:
                for name in names:
                    tensor_slice = _get_slice(f, path, name)
                    dtype = _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype())
                    if dtype is None:
                        raise LitsftError(
                            f"{path}: tensor {name!r} has dtype {tensor_slice.get_dtype()} which litsft does not read"
                        )
                    infos[name] = (tuple(tensor_slice.get_shape()), dtype)
        else:
            state_dict = _load_bin(path)
            for name in names:
                tensor = _get_bin_tensor(state_dict, path, name)
                infos[name] = (tuple(tensor.shape), tensor.dtype)
    return infos


def iter_tensors(directory: Path, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for the tensors of `directory` (all, or `names`), one file open at a time."""
    file_map = weight_file_map(directory)
    if names is not None:
        file_map = {name: file_map[name] for name in names}
    for path, file_names in _group_by_file(file_map).items():
        if path.suffix == ".safetensors":
            with _open_safetensors(path) as f:
                for name in file_names:
                    _get_slice(f, path, name)  # a clear error for a name the index lists but the file lacks
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as err:  # any read failure means a damaged file
                        raise LitsftError(
                            f"{path}: cannot read tensor {name!r} ({_first_line(err)}); the file is damaged, "
                            "download it again"
                        ) from None
                    yield name, tensor
        else:
            state_dict = _load_bin(path)
            for name in file_names:
                yield name, _get_bin_tensor(state_dict, path, name)
            del state_dict


def _group_by_file(file_map: dict[str, Path]) -> dict[Path, list[str]]:
    groups: dict[Path, list[str]] = {}
    for name, path in file_map.items():
        groups.setdefault(path, []).append(name)
    return dict(sorted(groups.items()))


def _read_names(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        with _open_safetensors(path) as f:
            return list(f.keys())
    return list(_load_bin(path))


@contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    try:
        handle = safe_open(path, framework="pt")
    except Exception as err:  # safetensors has its own error types
        raise LitsftError(
            f"{path} is not a valid safetensors file ({_first_line(err)}); it may be truncated, download it again"
        ) from None
    with handle as f:
        yield f


def _get_slice(f: Any, path: Path, name: str) -> Any:
    try:
        return f.get_slice(name)
    except Exception:  # safetensors has its own error types
        raise LitsftError(
            f"{path} has no tensor {name!r} although the index lists it there; download the checkpoint again"
        ) from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A .bin state dict, memory-mapped. weights_only=True: unpickling a user file must never run code."""
    try:
        try:
            state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            # Files in torch's legacy (pre-1.6) format cannot be memory-mapped.
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # weights_only names the first global it refused, e.g. "GLOBAL posix.system".
        refused = re.search(r"GLOBAL (\S+)", str(err))
        if refused:
            raise LitsftError(
                f"{path} holds Python objects other than tensors ({refused.group(1)}) and litsft refuses to "
                "unpickle them; use a safetensors checkpoint or a plain state dict of tensors"
            ) from None
        raise LitsftError(f"{path} is not a readable PyTorch weights file; download it again") from None
    except Exception:  # torch raises several types for damaged archives; their text is multi-line
        raise LitsftError(f"{path} is not a readable PyTorch weights file; download it again") from None
    if not isinstance(state_dict, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state_dict.items()
    ):
        raise LitsftError(
            f"{path} is not a plain state dict (a dict of tensor names to tensors); save the model's "
            "state_dict() or use safetensors"
        )
    return state_dict


def _get_bin_tensor(state_dict: dict[str, torch.Tensor], path: Path, name: str) -> torch.Tensor:
    if name not in state_dict:
        raise LitsftError(
            f"{path} has no tensor {name!r} although the index lists it there; download the checkpoint again"
        )
    return state_dict[name]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---- litsft checkpoint directories ----------------------------------------------------------------------
def checkpoint_tensor_shapes(checkpoint_dir: Path) -> dict[str, TensorInfo]:
    """Name -> (shape, dtype) of the tensors stored in a litsft checkpoint, from the file headers only."""
    Config.from_checkpoint(checkpoint_dir)  # a clear error for a directory that is not a litsft checkpoint
    return tensor_infos(checkpoint_dir)


def iter_checkpoint_tensors(
    checkpoint_dir: Path, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the stored (name, tensor) pairs of a litsft checkpoint one at a time, e.g. to fill a model
    built on the meta device shard by shard. A tied `lm_head.weight` is not stored and not yielded."""
    Config.from_checkpoint(checkpoint_dir)
    yield from iter_tensors(checkpoint_dir, names)


def load_checkpoint_state_dict(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The full state dict of a litsft checkpoint, ready for `Transformer(config).load_state_dict(sd)`.
    With tied embeddings `lm_head.weight` is added as the same tensor as `embed.weight`, as
    `Transformer.state_dict()` has it."""
    config = Config.from_checkpoint(checkpoint_dir)
    state_dict = dict(iter_tensors(checkpoint_dir))
    if config.tie_word_embeddings and "embed.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["embed.weight"]
    return state_dict


def save_checkpoint_files(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: Config,
    out_dir: Path,
    tokenizer_source_dir: Path | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write a litsft checkpoint directory: config, weights (streamed, sharded past `max_shard_size`) and the
    tokenizer files of `tokenizer_source_dir`. A tied `lm_head.weight` is skipped: loading restores it from
    `embed.weight`. Weights saved earlier in `out_dir` are replaced."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.tie_word_embeddings:
        named_tensors = ((n, t) for n, t in named_tensors if n != "lm_head.weight")
    write_safetensors(named_tensors, out_dir, max_shard_size)
    if tokenizer_source_dir is not None:
        copy_tokenizer_files(tokenizer_source_dir, out_dir)
    # Config last: a directory with litsft_config.json is a finished checkpoint.
    config.save(out_dir)
