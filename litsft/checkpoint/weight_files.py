"""Weight files, with no notion of what the tensors mean: read and written one tensor at a time, so
converting or loading a 70B model never needs two full copies of it in memory.

Reads Hugging Face layouts (`model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
`pytorch_model.bin`, sharded `.bin` with `pytorch_model.bin.index.json`) and writes safetensors shards named
the way Hugging Face names them. Files are written with the permissions the umask gives any other file
(safetensors alone would make them private to their owner).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from litsft.errors import LitsftError
from litsft.runtime.files import first_line, make_readable_like_other_files, read_json, write_json

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
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


# ---- writing weights -------------------------------------------------------------------------------------
def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """One safetensors file, with transformers' format metadata and the permissions of any other file."""
    save_file(dict(tensors), path, metadata={**SAFETENSORS_METADATA, **(metadata or {})})
    make_readable_like_other_files(path)


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
        if starts_next_shard(len(self.shard), self.shard_bytes, tensor.nbytes, self.max_shard_bytes):
            self.flush()
        self.shard[name] = tensor
        self.shard_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def flush(self) -> None:
        if not self.shard:
            return
        path = self.out_dir / f"model-{len(self.written) + 1:05d}.safetensors.partial"
        save_safetensors(self.shard, path)
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
                save_safetensors({}, final)
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
        write_json(self.out_dir / SAFETENSORS_INDEX_NAME, index)
        return files


def starts_next_shard(shard_tensors: int, shard_bytes: int, nbytes: int, max_bytes: int) -> bool:
    """The sharding rule: a tensor of `nbytes` that would take a shard already holding tensors past
    `max_bytes` starts the next one (a single larger tensor gets a shard of its own)."""
    return shard_tensors > 0 and shard_bytes + nbytes > max_bytes


def shard_numbers(sizes: Iterable[tuple[str, int]], max_shard_size: str | int) -> dict[str, int]:
    """The shard (1, 2, ...) each tensor of (name, bytes) goes to, in order, by the rule
    `ShardedSafetensorsWriter` follows (`starts_next_shard`)."""
    max_bytes, numbers, shard, shard_tensors, shard_bytes = parse_size(max_shard_size), {}, 1, 0, 0
    for name, nbytes in sizes:
        if starts_next_shard(shard_tensors, shard_bytes, nbytes, max_bytes):
            shard, shard_tensors, shard_bytes = shard + 1, 0, 0
        numbers[name] = shard
        shard_tensors, shard_bytes = shard_tensors + 1, shard_bytes + nbytes
    return numbers


def write_safetensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Stream tensors into (possibly sharded) safetensors files in `out_dir`; returns the files written."""
    remove_saved_weights(Path(out_dir))
    writer = ShardedSafetensorsWriter(out_dir, max_shard_size)
    for name, tensor in named_tensors:
        writer.add(name, tensor)
    return writer.close()


def remove_saved_weights(directory: Path) -> None:
    """Delete weights an earlier save left in `directory`, so old shards cannot mix with new ones."""
    for path in directory.glob("model*.safetensors*"):
        if path.name in (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME) or _SHARD_NAME.fullmatch(path.name):
            path.unlink()


# ---- reading weights -------------------------------------------------------------------------------------
def weight_file_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, for a directory in any of the layouts above. Checks that every file
    an index names exists, so a missing shard is reported before anything is read or written."""
    directory = Path(directory)
    for index_name in (SAFETENSORS_INDEX_NAME, BIN_INDEX_NAME):
        index_path = directory / index_name
        if index_path.is_file():
            return _indexed_files(directory, index_path)
    for file_name in (SAFETENSORS_NAME, BIN_NAME):
        path = directory / file_name
        if path.is_file():
            return dict.fromkeys(_read_names(path), path)
    raise LitsftError(
        f"no weights in {directory}: expected {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME}, {BIN_NAME} or "
        f"{BIN_INDEX_NAME}"
    )


def _indexed_files(directory: Path, index_path: Path) -> dict[str, Path]:
    try:
        weight_map = read_json(index_path)["weight_map"]
        files = {name: directory / file for name, file in weight_map.items()}
    except (KeyError, TypeError, AttributeError) as err:
        raise LitsftError(
            f"{index_path} is not a weights index (no valid 'weight_map': {err}); restore it from the original checkpoint"
        ) from None
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise LitsftError(
                f"{path.name} is listed in {index_path} but missing from {directory}; "
                "copy the complete checkpoint (all shards)"
            )
    return files


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
                            f"{path}: cannot read tensor {name!r} ({first_line(err)}); the file is damaged, "
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


def load_safetensors(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a file that is not one is refused in a line ending in `fix`."""
    return load_safetensors_and_metadata(path, fix)[0]


def load_safetensors_and_metadata(path: Path, fix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`load_safetensors`, and the metadata of the file's header."""
    with _open_safetensors(path, fix) as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


@contextmanager
def _open_safetensors(path: Path, fix: str = "it may be truncated, download it again") -> Iterator[Any]:
    try:
        handle = safe_open(path, framework="pt")
    except Exception as err:  # safetensors has its own error types
        raise LitsftError(f"{path} is not a valid safetensors file ({first_line(err)}); {fix}") from None
    with handle as f:
        yield f


def _get_slice(f: Any, path: Path, name: str) -> Any:
    try:
        return f.get_slice(name)
    except Exception:  # safetensors has its own error types
        raise LitsftError(
            f"{path} has no tensor {name!r} although the index lists it there; download the checkpoint again"
        ) from None


def refused_global(err: pickle.UnpicklingError) -> str | None:
    """The global that `torch.load(weights_only=True)` refused to unpickle, e.g. "posix.system"."""
    refused = re.search(r"GLOBAL (\S+)", str(err))
    return refused.group(1) if refused else None


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
        refused = refused_global(err)
        if refused:
            raise LitsftError(
                f"{path} holds Python objects other than tensors ({refused}) and litsft refuses to "
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
