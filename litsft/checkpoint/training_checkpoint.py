"""Training checkpoints: sharded save, atomic publish, exact resume, rotation, and the RNG state they carry.

Layout of `out_dir/step-00000012/`:
    shards/shard-00001-model-00001-of-00001.safetensors ...
                                       the model parameters and optimizer state, each rank's part of every
                                       tensor in its own file, written by torch.distributed.checkpoint (DCP)
                                       with its Hugging Face safetensors storage (`sharded_tensors`)
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

Tensors are stored under `model/<parameter name>` and `optimizer/<parameter name>/<state key>` in whatever
placement the run holds them (FSDP2's dim-0 shards, replicas written once, any other DTensor placement),
and DCP reads them back into any placement and number of ranks. Optimizer state is restored into tensors
of the dtype it was saved in, not through `Optimizer.load_state_dict` (or DCP's `set_state_dict`, which
calls it): that casts every floating state to its parameter's dtype, which would round CompensatedAdamW's
fp32 moments of a bf16 weight to bf16.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager

from litsft.checkpoint.checkpoint_dirs import (
    CHECKPOINT_FORMAT,
    DELETING_SUFFIX,
    PARTIAL_SUFFIX,
    STEP_PREFIX,
    TRAINER_STATE,
    checkpoint_name,
    is_complete,
    latest_checkpoint,
    read_trainer_state,
)
from litsft.checkpoint.sharded_tensors import (
    ShardedReader,
    first_failure,
    global_rank,
    save_sharded,
    save_sharded_in_background,
    world_size,
)
from litsft.checkpoint.weight_files import refused_global
from litsft.errors import LitsftError
from litsft.runtime.faults import fault_point
from litsft.runtime.files import first_line, fsync_path, write_bytes, write_json

SHARDS_DIR = "shards"


# ---- saving ---------------------------------------------------------------------------------------------
def _trainable_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def checkpoint_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, with_frozen: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores, by their names in it: `model/<name>` for every parameter (the
    trainable ones only without `with_frozen`), `optimizer/<name>/<key>` for every optimizer state tensor."""
    parameters = dict(model.named_parameters()) if with_frozen else _trainable_named_parameters(model)
    tensors = {f"model/{name}": param.detach() for name, param in parameters.items()}
    names_of = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{names_of[id(param)]}/{key}"] = value
    return tensors


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
    save = _CheckpointSave(out_dir, step, model, optimizer, trainer_state, rank_state)
    try:
        save_sharded(checkpoint_tensors(model, optimizer, save_frozen), save.partial / SHARDS_DIR)
        error = None
    except Exception as err:  # DCP hands back the failing rank's own exception, on every rank
        error = err
    fault_point(f"save_{step}_shards_written", save.rank)
    save.fail_together(error)  # also the barrier: every rank's files are on disk
    save.fail_together(save.publish())  # also the barrier: nobody moves on before the checkpoint is published
    return save.final


class BackgroundSave:
    """A checkpoint being written by a thread while training goes on (see `start_background_save`)."""

    def __init__(self, save: _CheckpointSave, written: Future, keep_last: int | None) -> None:
        self.save, self.keep_last = save, keep_last
        self.final = save.final
        self._published: Future = Future()
        written.add_done_callback(self._publish)

    def _publish(self, written: Future) -> None:
        # In the writing thread, once every rank's files are on disk (rank 0's future ends last: it
        # gathers the others' results); only rank 0 publishes, as in a synchronous save.
        try:
            error = written.exception()
            if error is None:
                fault_point(f"save_{self.save.step}_shards_written", self.save.rank)
                error = self.save.publish()
            if error is None:
                rotate_checkpoints(self.save.out_dir, self.keep_last)
        except Exception as err:  # raised here it would be lost, and wait() would wait forever
            error = err
        self._published.set_result(error)

    def wait(self) -> Path:
        """Wait until the checkpoint is published; a failure on any rank raises the same LitsftError on every
        rank. Collective: every rank calls it at the same point of the loop."""
        self.save.fail_together(self._published.result())
        return self.final


def start_background_save(
    out_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    save_frozen: bool,
    process_group: Any,
    keep_last: int | None,
    stager: AsyncStager | None = None,
) -> BackgroundSave:
    """`save_training_checkpoint` and then `rotate_checkpoints`, returning once this rank's tensors are
    copied to host memory (by `stager`: `sharded_tensors.pinned_stager` on a GPU); a thread writes them and
    publishes the checkpoint (the same staging directory and one rename) while training goes on. Until
    `wait()` says so, the newest complete checkpoint is the previous one, also after a kill. `process_group`
    is a gloo group for the writes alone. Collective."""
    save = _CheckpointSave(out_dir, step, model, optimizer, trainer_state, rank_state)
    tensors = checkpoint_tensors(model, optimizer, save_frozen)
    written = save_sharded_in_background(
        tensors,
        save.partial / SHARDS_DIR,
        process_group,
        before_write=lambda: fault_point(f"save_{step}_writing_in_background", save.rank),
        stager=stager,
    )
    return BackgroundSave(save, written, keep_last)


class _CheckpointSave:
    """One checkpoint's staging directory, the files every rank writes into it besides the tensors, its
    publication, and failing on every rank together. Creating it is collective."""

    def __init__(
        self,
        out_dir: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        rank_state: dict[str, Any],
    ) -> None:
        self.out_dir, self.step, self.rank = out_dir, step, global_rank()
        self.final = out_dir / checkpoint_name(step)
        self.partial = out_dir / f".{checkpoint_name(step)}{PARTIAL_SUFFIX}"
        self.previous = latest_checkpoint(out_dir)
        # Taken now, not when the files are on disk: the learning rate moves on with training.
        self.trainer_state = dict(trainer_state, step=step, world_size=world_size(), format=CHECKPOINT_FORMAT)
        self.trainer_state["param_groups"] = _param_groups_by_name(model, optimizer)
        error = None
        if self.rank == 0:
            try:
                if self.partial.exists():
                    shutil.rmtree(self.partial)
                (self.partial / SHARDS_DIR).mkdir(parents=True)
            except OSError as err:
                error = err
        self.fail_together(error)  # also the barrier: no rank writes before the directory exists
        fault_point(f"save_{step}_started", self.rank)
        error = None
        try:
            fault_point(f"save_{step}_writing", self.rank)
            _write_rank_state(self.partial, self.rank, rank_state)
        except OSError as err:
            error = err
        # Before DCP's save, which is collective: a rank that failed already must not leave the others in it.
        self.fail_together(error)

    def fail_together(self, error: BaseException | None) -> None:
        failure = first_failure(error)
        if failure is not None:
            if self.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)
            failed_rank, message = failure
            kept = f"{self.previous.name} is intact" if self.previous else "no earlier checkpoint exists"
            raise LitsftError(
                f"could not write checkpoint {self.final} (rank {failed_rank}: {message}); {kept}: free disk "
                "space or fix permissions, then relaunch the same command to resume"
            )

    def publish(self) -> OSError | None:
        """On rank 0, once every rank's files are on disk: trainer_state.json listing them, then the rename."""
        if self.rank != 0:
            return None
        try:
            partial = self.partial
            files = {str(p.relative_to(partial)): p.stat().st_size for p in partial.rglob("*") if p.is_file()}
            state = dict(self.trainer_state, files=sorted(files), file_sizes=files)
            write_json(partial / TRAINER_STATE, state, durable=True)
            fault_point(f"save_{self.step}_before_rename", self.rank)
            os.replace(partial, self.final)
            fsync_path(self.out_dir)
        except OSError as err:
            return err
        return None


def _write_rank_state(partial: Path, rank: int, rank_state: dict[str, Any]) -> None:
    """This rank's own state (RNG, data loader, loss scale), fsynced."""
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
def _fix_for_damaged(checkpoint_dir: Path) -> str:
    """What to do when a file of checkpoint_dir is damaged though its size is the one it was written with."""
    return (
        f"move {checkpoint_dir} aside (rename it) to resume from the checkpoint before it, or pass "
        "--resume <an older step dir>"
    )


def stored_tensors(checkpoint_dir: Path) -> ShardedReader:
    """The tensors a checkpoint stores (see `checkpoint_tensors` for their names), read from file headers."""
    return ShardedReader(checkpoint_dir / SHARDS_DIR, _fix_for_damaged(checkpoint_dir))


@torch.no_grad()
def load_training_checkpoint(
    checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, load_frozen: bool = True
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore model and optimizer in place (resharding if the world size or placement changed); return the
    trainer state and this rank's own state (None when the checkpoint was written by a different number of
    ranks). Collective."""
    state = read_trainer_state(checkpoint_dir)
    reader = stored_tensors(checkpoint_dir)
    stored = reader.stored()
    parameters = dict(model.named_parameters()) if load_frozen else _trainable_named_parameters(model)
    missing = sorted(name for name in parameters if f"model/{name}" not in stored)
    if missing:
        raise LitsftError(
            f"{checkpoint_dir} has no weights for {missing[:3]}; it was written for a different model"
        )
    targets = {f"model/{name}": param.data for name, param in parameters.items()}
    optimizer_state = _empty_optimizer_state(checkpoint_dir, state["param_groups"], model, optimizer, stored)
    for name, param_state in optimizer_state.items():
        targets.update({f"optimizer/{name}/{key}": value for key, value in param_state.items()})
    reader.load(targets)
    param_of = dict(model.named_parameters())
    for name, param_state in optimizer_state.items():
        optimizer.state[param_of[name]] = param_state
    rank_state = None
    if state["world_size"] == world_size():
        rank_state = load_rank_state(checkpoint_dir / f"rank-{global_rank():05d}.pt")
    return state, rank_state


def _empty_optimizer_state(
    checkpoint_dir: Path,
    saved_groups: list[dict[str, Any]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name, a tensor for each optimizer state the checkpoint holds, of its stored dtype and
    the parameter's placement, to be filled; the saved hyper-parameters this run does not set are taken."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise LitsftError(
            f"{checkpoint_dir} holds {len(saved_groups)} optimizer parameter groups, this run has "
            f"{len(optimizer.param_groups)}; resume with the recipe and options that wrote it"
        )
    param_of = dict(model.named_parameters())
    empty: dict[str, dict[str, torch.Tensor]] = {}
    for saved, group in zip(saved_groups, optimizer.param_groups):
        # This run's hyper-parameters win: a changed one is announced before launch (validation.schedule_changes).
        for key, value in saved.items():
            group.setdefault(key, value)
        for name in saved["params"]:
            param, prefix = param_of[name], f"optimizer/{name}/"
            param_state = {}
            # Every state the optimizer saved (AdamW's moments, a compensation buffer), in its saved dtype.
            for stored_name in sorted(n for n in stored if n.startswith(prefix)):
                key, (shape, dtype) = stored_name.removeprefix(prefix), stored[stored_name]
                if not shape:  # a scalar, e.g. Adam's step count
                    fused = group.get("fused") or group.get("capturable")
                    param_state[key] = torch.zeros((), dtype=dtype, device=param.device if fused else "cpu")
                else:
                    param_state[key] = torch.zeros_like(param.data, dtype=dtype)
            if param_state:
                empty[name] = param_state
    return empty


def load_rank_zero_state(checkpoint_dir: Path) -> dict[str, Any]:
    return load_rank_state(checkpoint_dir / "rank-00000.pt")


def load_rank_state(path: Path) -> dict[str, Any]:
    """A rank's RNG and data-loader state. weights_only=True: unpickling a file must never run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = refused_global(err)
        if refused:
            raise LitsftError(
                f"{path} holds Python objects other than plain data ({refused}) and litsft refuses to unpickle "
                "them; resume from a checkpoint litsft wrote"
            ) from None
        # No global named: the bytes are no pickle torch.save wrote (overwritten at the same size, so the
        # size check before resuming let them through).
        raise LitsftError(
            f"{path} is damaged (not a file torch.save wrote); {_fix_for_damaged(path.parent)}"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise LitsftError(f"{path} is damaged ({first_line(err)}); {_fix_for_damaged(path.parent)}") from None


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
