"""Rows of possibly sharded tensors: which rows of a parameter this rank holds (FSDP2 shards along dim 0),
reading any rows of a tensor stored as row blocks across safetensors files, and the rank helpers that
saving and loading collectively need. The same reader fills a model from a litsft model folder (one
block per tensor) and from a training checkpoint (one block per rank that wrote it), whatever the number
of ranks now, without any rank building a full copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from litsft.errors import LitsftError
from litsft.model.float8 import without_float8_wrapper
from litsft.runtime.files import first_line

RowBlock = tuple[Path, str, int, int]  # (file, key in the file, first row, row count)


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def first_failure(error: BaseException | None) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank that failed, the same on every rank; None if none failed.
    Collective: every rank calls it, so a failure on one rank never leaves the others waiting."""
    message = "" if error is None else first_line(error)
    messages = [message]
    if world_size() > 1:
        messages = [""] * world_size()
        dist.all_gather_object(messages, message)
    for rank, text in enumerate(messages):
        if text:
            return rank, text
    return None


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(rows this rank holds, their offset along dim 0, whether this rank is the one that saves them), as a
    plain tensor (float8 all-gather's wrapper taken off: it shares the storage)."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = without_float8_wrapper(tensor.to_local())
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        coordinate = tensor.device_mesh.get_coordinate() or []
        # Replicated copies (HYBRID_SHARD, NO_SHARD) are identical: only replica 0 writes them.
        is_writer = all(c == 0 for c, p in zip(coordinate, tensor.placements) if p.is_replicate())
        if local.dim() > 0 and any(o for o in offset[1:]):
            raise NotImplementedError("only dim-0 sharding is supported")
        return local, (offset[0] if len(offset) else 0), is_writer and local.numel() > 0
    return without_float8_wrapper(tensor), 0, global_rank() == 0


@torch.no_grad()
def copy_rows(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of the full tensor `full` into `target` (a plain tensor or a DTensor)."""
    local, offset, _ = local_rows(target)
    local.copy_(full[offset : offset + local.shape[0]] if local.dim() else full)


def full_tensors(
    named: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) one at a time. Every rank must iterate (gathering is collective)."""
    for name, tensor in named.items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = without_float8_wrapper(full).detach().to("cpu")
        yield name, full.to(dtype) if dtype is not None and full.is_floating_point() else full


class RowReader:
    """Reads rows [start, end) of named tensors stored as row blocks across safetensors files.

    Each read opens its file and closes it again. safetensors maps the whole file and returns tensors that
    are views of the mapping, and every page read through a mapping counts in the process's resident
    memory until the mapping goes: an open handle kept for the whole load left every page this rank had
    read resident, up to the whole checkpoint on each rank (QLoRA reads each NF4 weight whole). Closed
    after each read, a mapping lives only as long as the tensor read from it."""

    def __init__(self, blocks: dict[str, list[RowBlock]]) -> None:
        self.blocks = blocks  # name -> its row blocks

    def names(self) -> set[str]:
        return set(self.blocks)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        pieces = []
        for path, key, first, count in sorted(self.blocks[name], key=lambda b: b[2]):
            lo, hi = max(start, first), min(end, first + count)
            if lo >= hi:
                continue
            with safe_open(path, framework="pt") as handle:
                tensor_slice = handle.get_slice(key)
                if tensor_slice.get_shape():
                    pieces.append(tensor_slice[lo - first : hi - first])
                else:  # a scalar, e.g. Adam's step count
                    pieces.append(handle.get_tensor(key))
        if not pieces:
            raise LitsftError(
                f"rows {start}:{end} of {name!r} are in no checkpoint file; the checkpoint is incomplete"
            )
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def fill(self, name: str, target: torch.Tensor) -> None:
        """Copy this rank's rows of tensor `name` into `target` (a plain tensor or a DTensor)."""
        local, offset, _ = local_rows(target)
        if local.numel() == 0:
            return
        rows = self.read(name, offset, offset + (local.shape[0] if local.dim() else 1))
        if rows.shape != local.shape and rows.numel() == local.numel():
            rows = rows.reshape(local.shape)
        if rows.shape != local.shape:
            raise LitsftError(
                f"{name}: checkpoint rows have shape {tuple(rows.shape)} but the model expects {tuple(local.shape)}; "
                "the checkpoint does not belong to this model config"
            )
        with torch.no_grad():
            local.copy_(rows)
