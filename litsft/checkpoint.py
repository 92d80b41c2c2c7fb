"""Training checkpoints: sharded save, atomic publish, exact resume, and loading weights shard by shard.

Layout of `out_dir/step-00000012/`:
    shards/rank-00000.safetensors ...  each rank's rows of every model parameter and optimizer state
    rank-00000.pt ...                  each rank's RNG states and data-loader state
    trainer_state.json                 step, epoch, optimizer hyper-parameters, the run config, file list

A checkpoint is written under `.step-00000012.partial/` and renamed once every rank's files are on disk
(fsynced) and `trainer_state.json`, listing every file with its size, is written, so a crash mid-write
never leaves a directory that looks complete. A write that fails on any rank (disk full, permissions) fails
on every rank with the same message, so none waits forever for the others, and the partial directory is
removed; older checkpoints are deleted only after a new one is published.

Every tensor is stored as the rows this rank holds plus their offset in the full tensor. FSDP2 shards
along dim 0, so loading reads exactly the rows a rank needs, from whichever files hold them: the same
code loads a checkpoint into a different number of ranks, and fills a meta-device model from a litsft
weights directory without any rank building a full copy.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from litsft.errors import LitsftError
from litsft.faults import fault_point
from litsft.weight_files import weight_file_map

STEP_PREFIX = "step-"
PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
TRAINER_STATE = "trainer_state.json"
SHARDS_DIR = "shards"


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


# ---- rows of possibly sharded tensors --------------------------------------------------------------------
def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(rows this rank holds, their offset along dim 0, whether this rank is the one that saves them)."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = tensor.to_local()
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        coordinate = tensor.device_mesh.get_coordinate() or []
        # Replicated copies (HYBRID_SHARD, NO_SHARD) are identical: only replica 0 writes them.
        is_writer = all(c == 0 for c, p in zip(coordinate, tensor.placements) if p.is_replicate())
        if local.dim() > 0 and any(o for o in offset[1:]):
            raise NotImplementedError("only dim-0 sharding is supported")
        return local, (offset[0] if len(offset) else 0), is_writer and local.numel() > 0
    return tensor, 0, global_rank() == 0


class RowReader:
    """Reads rows [start, end) of named tensors stored as row blocks across safetensors files."""

    def __init__(self, blocks: dict[str, list[tuple[Path, str, int, int]]]) -> None:
        self.blocks = blocks  # name -> [(file, key in file, first row, row count)]
        self._handles: dict[Path, Any] = {}

    @classmethod
    def for_weights_dir(cls, directory: Path) -> RowReader:
        """Whole tensors of a litsft weights directory (model.safetensors or shards + index)."""
        blocks = {}
        for name, path in weight_file_map(directory).items():
            with safe_open(path, framework="pt") as f:
                shape = f.get_slice(name).get_shape()
            blocks[name] = [(path, name, 0, shape[0] if shape else 1)]
        return cls(blocks)

    @classmethod
    def for_training_checkpoint(cls, checkpoint_dir: Path, prefix: str) -> RowReader:
        blocks: dict[str, list[tuple[Path, str, int, int]]] = {}
        for path in sorted((checkpoint_dir / SHARDS_DIR).glob("rank-*.safetensors")):
            try:
                with safe_open(path, framework="pt") as f:
                    offsets = json.loads((f.metadata() or {}).get("row_offsets", "{}"))
                    for key in f.keys():
                        if key.startswith(prefix):
                            shape = f.get_slice(key).get_shape()
                            rows = shape[0] if shape else 1
                            blocks.setdefault(key[len(prefix) :], []).append((path, key, offsets[key], rows))
            except (SafetensorError, OSError, ValueError, KeyError) as err:
                raise LitsftError(
                    f"{path} is damaged ({_first_line(err)}); delete {checkpoint_dir} to resume from the "
                    "checkpoint before it, or pass --resume <an older step dir>"
                ) from None
        return cls(blocks)

    def names(self) -> set[str]:
        return set(self.blocks)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        pieces = []
        for path, key, first, count in sorted(self.blocks[name], key=lambda b: b[2]):
            lo, hi = max(start, first), min(end, first + count)
            if lo >= hi:
                continue
            handle = self._handles.get(path) or self._handles.setdefault(
                path, safe_open(path, framework="pt")
            )
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


@torch.no_grad()
def load_weights(
    model: nn.Module, weights_dir: Path, stored_name: Callable[[str], str | None] = lambda name: name
) -> None:
    """Fill `model` (materialized, possibly sharded) from a litsft weights directory, each rank reading only
    its own rows. `stored_name` maps a parameter name to its name on disk, or None for one not loaded
    (LoRA's adapters; its frozen `...q_proj.base.weight` is stored as `...q_proj.weight`)."""
    reader = RowReader.for_weights_dir(weights_dir)
    missing = []
    for name, param in model.named_parameters():  # a tied lm_head is the embedding, listed once
        stored = stored_name(name)
        if stored is None:
            continue
        if stored not in reader.names():
            missing.append(stored)
            continue
        reader.fill(stored, param.data)
    if missing:
        raise LitsftError(
            f"{weights_dir} lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}; "
            "it was converted from a different model"
        )


@torch.no_grad()
def copy_rows(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of the full tensor `full` into `target` (a plain tensor or a DTensor)."""
    local, offset, _ = local_rows(target)
    local.copy_(full[offset : offset + local.shape[0]] if local.dim() else full)


# ---- saving ---------------------------------------------------------------------------------------------
def _trainable_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save_training_checkpoint(
    out_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    save_frozen: bool = True,
) -> Path:
    """Write `out_dir/step-XXXXXXXX/` collectively (every rank calls this) and return its path. A failed
    write raises the same LitsftError on every rank and leaves the checkpoints already there as they were."""
    final = out_dir / checkpoint_name(step)
    partial = out_dir / f".{checkpoint_name(step)}{PARTIAL_SUFFIX}"
    rank = global_rank()
    previous = latest_checkpoint(out_dir)

    def fail_together(error: BaseException | None) -> None:
        failure = first_failure(error)
        if failure is not None:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            failed_rank, message = failure
            kept = f"{previous.name} is intact" if previous else "no earlier checkpoint exists"
            raise LitsftError(
                f"could not write checkpoint {final} (rank {failed_rank}: {message}); {kept}: free disk space "
                "or fix permissions, then relaunch the same command to resume"
            )

    error = None
    if rank == 0:
        try:
            if partial.exists():
                shutil.rmtree(partial)
            (partial / SHARDS_DIR).mkdir(parents=True)
        except OSError as err:
            error = err
    fail_together(error)  # also the barrier: no rank writes before the directory exists
    fault_point(f"save_{step}_started", rank)

    tensors: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}

    def add(key: str, tensor: torch.Tensor) -> None:
        local, offset, is_writer = local_rows(tensor)
        if is_writer:
            tensors[key] = local.detach().to("cpu").contiguous()
            offsets[key] = offset

    parameters = dict(model.named_parameters()) if save_frozen else _trainable_named_parameters(model)
    for name, param in parameters.items():
        add(f"model/{name}", param)
    names_of = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                add(f"optimizer/{names_of[id(param)]}/{key}", value)
    try:
        fault_point(f"save_{step}_writing", rank)
        shard_path = partial / SHARDS_DIR / f"rank-{rank:05d}.safetensors"
        save_file(tensors, shard_path, metadata={"row_offsets": json.dumps(offsets)})
        _fsync_file(shard_path)
        buffer = io.BytesIO()
        torch.save(rank_state, buffer)
        _write_bytes_durably(partial / f"rank-{rank:05d}.pt", buffer.getvalue())
        error = None
    except (OSError, SafetensorError, RuntimeError) as err:
        error = err
    fault_point(f"save_{step}_shards_written", rank)
    fail_together(error)  # also the barrier: every rank's files are on disk

    error = None
    if rank == 0:
        try:
            files = {str(p.relative_to(partial)): p.stat().st_size for p in partial.rglob("*") if p.is_file()}
            state = dict(
                trainer_state,
                step=step,
                world_size=world_size(),
                param_groups=[
                    {k: v for k, v in group.items() if k != "params"}
                    | {"params": [names_of[id(p)] for p in group["params"]]}
                    for group in optimizer.param_groups
                ],
                files=sorted(files),
                file_sizes=files,
            )
            _write_json_durably(partial / TRAINER_STATE, state)
            fault_point(f"save_{step}_before_rename", rank)
            os.replace(partial, final)
            _fsync_dir(out_dir)
        except OSError as err:
            error = err
    fail_together(error)  # also the barrier: nobody moves on before the checkpoint is published
    return final


def first_failure(error: BaseException | None) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank that failed, the same on every rank; None if none failed."""
    message = "" if error is None else _first_line(error)
    messages = [message]
    if world_size() > 1:
        messages = [""] * world_size()
        dist.all_gather_object(messages, message)
    for rank, text in enumerate(messages):
        if text:
            return rank, text
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _write_bytes_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_durably(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, default=_json_default)
        f.flush()
        os.fsync(f.fileno())


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- finding and loading -----------------------------------------------------------------------------
def is_complete(checkpoint_dir: Path) -> bool:
    state_path = checkpoint_dir / TRAINER_STATE
    if not state_path.is_file():
        return False
    try:
        state = json.loads(state_path.read_text())
        files, sizes = state["files"], state.get("file_sizes", {})
    except (json.JSONDecodeError, KeyError, TypeError):
        return False
    for name in files:
        path = checkpoint_dir / name
        if not path.is_file() or (name in sizes and path.stat().st_size != sizes[name]):
            return False
    return True


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete `step-*` checkpoint in out_dir; partial or damaged ones are never picked."""
    if not out_dir.is_dir():
        return None
    candidates = sorted(
        p for p in out_dir.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name[len(STEP_PREFIX) :].isdigit()
    )
    for candidate in reversed(candidates):
        if is_complete(candidate):
            return candidate
    return None


def resume_checkpoint(resume: bool | str | Path, out_dir: Path) -> Path | None:
    """The checkpoint a run resumes from: the newest complete one in out_dir ("auto"/true), a given
    directory, or none (false)."""
    if resume is False or resume is None:
        return None
    if resume in ("auto", True):
        return latest_checkpoint(out_dir)
    path = Path(resume)
    if not path.is_dir():
        raise LitsftError(
            f"--resume {path}: no such checkpoint directory; pass an existing step-XXXXXXXX dir or auto"
        )
    return path


def read_trainer_state(checkpoint_dir: Path) -> dict[str, Any]:
    if not is_complete(checkpoint_dir):
        raise LitsftError(
            f"{checkpoint_dir} is not a complete litsft training checkpoint "
            f"({TRAINER_STATE} or a file it lists is missing or truncated); pass another one or --resume auto"
        )
    return json.loads((checkpoint_dir / TRAINER_STATE).read_text())


@torch.no_grad()
def load_training_checkpoint(
    checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, load_frozen: bool = True
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore model and optimizer in place (resharding if the world size changed); return the trainer state
    and this rank's own state (None when the checkpoint was written by a different number of ranks)."""
    state = read_trainer_state(checkpoint_dir)
    model_rows = RowReader.for_training_checkpoint(checkpoint_dir, "model/")
    parameters = dict(model.named_parameters()) if load_frozen else _trainable_named_parameters(model)
    missing = sorted(set(parameters) - model_rows.names())
    if missing:
        raise LitsftError(
            f"{checkpoint_dir} has no weights for {missing[:3]}; it was written for a different model"
        )
    for name, param in parameters.items():
        model_rows.fill(name, param.data)

    optimizer_rows = RowReader.for_training_checkpoint(checkpoint_dir, "optimizer/")
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise LitsftError(
            f"{checkpoint_dir} holds {len(saved_groups)} optimizer parameter groups, this run has "
            f"{len(optimizer.param_groups)}; resume with the recipe and options that wrote it"
        )
    param_of = dict(model.named_parameters())
    for saved, group in zip(saved_groups, optimizer.param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
        for name in saved["params"]:
            param = param_of[name]
            param_state = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                stored = f"{name}/{key}"
                if stored not in optimizer_rows.names():
                    continue
                if key == "step":
                    step_tensor = optimizer_rows.read(stored, 0, 1).reshape(())
                    fused = group.get("fused") or group.get("capturable")
                    param_state[key] = step_tensor.to(param.device if fused else "cpu")
                else:
                    value = torch.zeros_like(param.data)
                    optimizer_rows.fill(stored, value)
                    param_state[key] = value
            if param_state:
                optimizer.state[param] = param_state

    rank_state = None
    if state["world_size"] == world_size():
        rank_state = load_rank_state(checkpoint_dir / f"rank-{global_rank():05d}.pt")
    return state, rank_state


def load_rank_zero_state(checkpoint_dir: Path) -> dict[str, Any]:
    return load_rank_state(checkpoint_dir / "rank-00000.pt")


def load_rank_state(path: Path) -> dict[str, Any]:
    """A rank's RNG and data-loader state. weights_only=True: unpickling a file must never run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = re.search(r"GLOBAL (\S+)", str(err))
        what = f" ({refused.group(1)})" if refused else ""
        raise LitsftError(
            f"{path} holds Python objects other than plain data{what} and litsft refuses to unpickle them; "
            "resume from a checkpoint litsft wrote"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise LitsftError(f"{path} is damaged ({_first_line(err)}); resume from another checkpoint") from None


def rotate_checkpoints(out_dir: Path, keep_last: int | None) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (called only after a new one is complete).
    Each is renamed first, so a crash mid-delete leaves a hidden directory (removed at the next start),
    never a half-deleted one under a checkpoint's name."""
    if not keep_last or global_rank() != 0:
        return
    complete = [p for p in sorted(out_dir.glob(f"{STEP_PREFIX}*")) if is_complete(p)]
    for old in complete[:-keep_last]:
        doomed = old.with_name(f".{old.name}{DELETING_SUFFIX}")
        try:
            os.replace(old, doomed)
        except OSError:
            continue  # an extra old checkpoint costs space, not correctness
        fault_point(f"rotate_{old.name}")
        shutil.rmtree(doomed, ignore_errors=True)


def remove_partial_checkpoints(out_dir: Path) -> None:
    """Remove what interrupted saves and deletes left behind (rank 0, before training starts)."""
    if global_rank() == 0 and out_dir.is_dir():
        for suffix in (PARTIAL_SUFFIX, DELETING_SUFFIX):
            for leftover in out_dir.glob(f".{STEP_PREFIX}*{suffix}"):
                shutil.rmtree(leftover, ignore_errors=True)


# ---- RNG --------------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- the consolidated final model --------------------------------------------------------------------------
def full_tensors(
    named: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) one at a time. Every rank must iterate (gathering is collective); rank 0 writes."""
    for name, tensor in named.items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach().to("cpu")
        yield name, full.to(dtype) if dtype is not None and full.is_floating_point() else full


def save_consolidated(model: nn.Module, out_dir: Path, config: Any, tokenizer_dir: Path | None) -> None:
    """Write the full model as a litsft checkpoint dir (what convert_to_hf and generate take), gathering one
    tensor at a time so rank 0 never holds more than one full tensor plus one file shard."""
    from litsft.weight_files import save_checkpoint_files

    dtype = getattr(torch, config.torch_dtype)
    tensors = full_tensors(model.state_dict(), dtype=dtype)
    if global_rank() == 0:
        save_checkpoint_files(tensors, config, out_dir, tokenizer_dir)
    else:
        for _ in tensors:  # take part in every gather
            pass
    barrier()
