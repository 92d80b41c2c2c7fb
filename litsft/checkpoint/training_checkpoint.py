"""Training checkpoints: sharded save, atomic publish, exact resume, rotation, and the RNG state they carry.

Layout of `out_dir/step-00000012/`:
    shards/rank-00000.safetensors ...  each rank's rows of every model parameter and optimizer state
    rank-00000.pt ...                  each rank's RNG states, data-loader state and (16-mixed) loss scale
    trainer_state.json                 step, epoch, optimizer hyper-parameters, the run config, file list

A checkpoint is written under `.step-00000012.partial/` and renamed once every rank's files are on disk
(fsynced) and `trainer_state.json`, listing every file with its size, is written, so a crash mid-write
never leaves a directory that looks complete. A write that fails on any rank (disk full, permissions) fails
on every rank with the same message, so none waits forever for the others, and the partial directory is
removed; older checkpoints are deleted only after a new one is published. (This publish is collective,
so it is not `formats.publish_atomically`, which serves outputs written by one process.)

Which checkpoints an out_dir holds, which are complete and which one a run resumes from is
`checkpoint_dirs` (no torch: the checks before launch use it).

Every tensor is stored as the rows this rank holds plus their offset in the full tensor (see
`sharded_rows`), so the same code loads a checkpoint into a different number of ranks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from litsft.checkpoint.checkpoint_dirs import (
    DELETING_SUFFIX,
    PARTIAL_SUFFIX,
    STEP_PREFIX,
    TRAINER_STATE,
    checkpoint_name,
    is_complete,
    latest_checkpoint,
    read_trainer_state,
)
from litsft.checkpoint.sharded_rows import (
    RowBlock,
    RowReader,
    first_failure,
    global_rank,
    local_rows,
    world_size,
)
from litsft.checkpoint.weight_files import refused_global, save_safetensors
from litsft.errors import LitsftError
from litsft.runtime.faults import fault_point
from litsft.runtime.files import first_line, fsync_path, write_bytes, write_json

SHARDS_DIR = "shards"


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
    try:
        fault_point(f"save_{step}_writing", rank)
        _write_rank_files(partial, rank, model, optimizer, rank_state, save_frozen)
        error = None
    except (OSError, SafetensorError, RuntimeError) as err:
        error = err
    fault_point(f"save_{step}_shards_written", rank)
    fail_together(error)  # also the barrier: every rank's files are on disk

    error = None
    if rank == 0:
        try:
            state = dict(trainer_state, step=step, world_size=world_size())
            state["param_groups"] = _param_groups_by_name(model, optimizer)
            files = {str(p.relative_to(partial)): p.stat().st_size for p in partial.rglob("*") if p.is_file()}
            state.update(files=sorted(files), file_sizes=files)
            write_json(partial / TRAINER_STATE, state, durable=True)
            fault_point(f"save_{step}_before_rename", rank)
            os.replace(partial, final)
            fsync_path(out_dir)
        except OSError as err:
            error = err
    fail_together(error)  # also the barrier: nobody moves on before the checkpoint is published
    return final


def _write_rank_files(
    partial: Path,
    rank: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state: dict[str, Any],
    save_frozen: bool,
) -> None:
    """This rank's rows of the parameters and optimizer state, and its own state, fsynced."""
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
    shard_path = partial / SHARDS_DIR / f"rank-{rank:05d}.safetensors"
    save_safetensors(tensors, shard_path, metadata={"row_offsets": json.dumps(offsets)})
    fsync_path(shard_path)
    buffer = io.BytesIO()
    torch.save(rank_state, buffer)
    write_bytes(partial / f"rank-{rank:05d}.pt", buffer.getvalue(), durable=True)


def _param_groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    names_of = {id(p): n for n, p in model.named_parameters()}
    return [
        {k: v for k, v in group.items() if k != "params"}
        | {"params": [names_of[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


# ---- loading ----------------------------------------------------------------------------------------------
def training_rows(checkpoint_dir: Path, prefix: str) -> RowReader:
    """A reader of the tensors under `prefix` ("model/", "optimizer/") in every rank's shard file."""
    blocks: dict[str, list[RowBlock]] = {}
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
                f"{path} is damaged ({first_line(err)}); move {checkpoint_dir} aside (rename it) to resume from "
                "the checkpoint before it, or pass --resume <an older step dir>"
            ) from None
    return RowReader(blocks)


@torch.no_grad()
def load_training_checkpoint(
    checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, load_frozen: bool = True
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore model and optimizer in place (resharding if the world size changed); return the trainer state
    and this rank's own state (None when the checkpoint was written by a different number of ranks)."""
    state = read_trainer_state(checkpoint_dir)
    model_rows = training_rows(checkpoint_dir, "model/")
    parameters = dict(model.named_parameters()) if load_frozen else _trainable_named_parameters(model)
    missing = sorted(set(parameters) - model_rows.names())
    if missing:
        raise LitsftError(
            f"{checkpoint_dir} has no weights for {missing[:3]}; it was written for a different model"
        )
    for name, param in parameters.items():
        model_rows.fill(name, param.data)
    _load_optimizer_state(checkpoint_dir, state["param_groups"], model, optimizer)
    rank_state = None
    if state["world_size"] == world_size():
        rank_state = load_rank_state(checkpoint_dir / f"rank-{global_rank():05d}.pt")
    return state, rank_state


def _load_optimizer_state(
    checkpoint_dir: Path,
    saved_groups: list[dict[str, Any]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    optimizer_rows = training_rows(checkpoint_dir, "optimizer/")
    if len(saved_groups) != len(optimizer.param_groups):
        raise LitsftError(
            f"{checkpoint_dir} holds {len(saved_groups)} optimizer parameter groups, this run has "
            f"{len(optimizer.param_groups)}; resume with the recipe and options that wrote it"
        )
    param_of = dict(model.named_parameters())
    stored_names = optimizer_rows.names()
    for saved, group in zip(saved_groups, optimizer.param_groups):
        # This run's hyper-parameters win: a changed one is announced before launch (validation.schedule_changes).
        for key, value in saved.items():
            group.setdefault(key, value)
        for name in saved["params"]:
            param = param_of[name]
            param_state = {}
            # Every state the optimizer saved (AdamW's moments, a compensation buffer), in its saved dtype.
            for key in sorted(n.removeprefix(f"{name}/") for n in stored_names if n.startswith(f"{name}/")):
                stored = f"{name}/{key}"
                if key == "step":
                    step_tensor = optimizer_rows.read(stored, 0, 1).reshape(())
                    fused = group.get("fused") or group.get("capturable")
                    param_state[key] = step_tensor.to(param.device if fused else "cpu")
                else:
                    value = torch.zeros_like(param.data, dtype=optimizer_rows.read(stored, 0, 1).dtype)
                    optimizer_rows.fill(stored, value)
                    param_state[key] = value
            if param_state:
                optimizer.state[param] = param_state


def load_rank_zero_state(checkpoint_dir: Path) -> dict[str, Any]:
    return load_rank_state(checkpoint_dir / "rank-00000.pt")


def load_rank_state(path: Path) -> dict[str, Any]:
    """A rank's RNG and data-loader state. weights_only=True: unpickling a file must never run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = refused_global(err)
        what = f" ({refused})" if refused else ""
        raise LitsftError(
            f"{path} holds Python objects other than plain data{what} and litsft refuses to unpickle them; "
            "resume from a checkpoint litsft wrote"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise LitsftError(f"{path} is damaged ({first_line(err)}); resume from another checkpoint") from None


# ---- cleaning up ------------------------------------------------------------------------------------------
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
