"""Training checkpoints: sharded save, atomic publish, exact resume, rotation, and the RNG state they carry.

Layout of `out_dir/step-00000012/`:
    shards/shard-00001-model-00001-of-00001.safetensors ...
                                       the model parameters and optimizer state, each rank's part of every
                                       tensor in its own file, written by torch.distributed.checkpoint (DCP)
                                       with its Hugging Face safetensors storage (`sharded_tensors`)
    rank-00000.safetensors ...         each rank's RNG states, data-loader state and (16-mixed) loss scale:
                                       its tensors as tensors, the rest as JSON in the header's metadata
    trainer_state.json                 step, epoch, optimizer hyper-parameters, the run config, file list

A checkpoint is written under `.step-00000012.partial/` and renamed once every rank's files are on disk
(fsynced) and `trainer_state.json`, listing every file with its size and checksum, is written, so a crash
mid-write never leaves a directory that looks complete. Each rank hashes the bytes of its files as it writes
them (`runtime.files.ChecksummedFile`); nothing is read back to hash it. A write that fails on any rank
(disk full, permissions) fails on every rank with the same message, so none waits forever for the others,
and the partial directory is removed; older checkpoints are deleted only after a new one is published.
(This publish is collective, so it is not `formats.publish_atomically`, which serves outputs written by one
process.)

Nothing a checkpoint holds is unpickled: the rank files of checkpoints written before they were safetensors
(`rank-00000.pt`) are read with torch's weights-only unpickler, which rebuilds tensors and plain data and
refuses any other object.

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

import errno
import json
import os
import pickle
import random
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
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
    first_message,
    global_rank,
    persistent_buffers,
    save_sharded,
    save_sharded_in_background,
    world_size,
)
from litsft.checkpoint.weight_files import load_safetensors_and_metadata, refused_global
from litsft.errors import LitsftError
from litsft.runtime.faults import fault_point
from litsft.runtime.files import first_line, fsync_path, readable_size, write_bytes, write_json

SHARDS_DIR = "shards"


# ---- saving ---------------------------------------------------------------------------------------------
def _trainable_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def checkpoint_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, with_frozen: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores, by their names in it: `model/<name>` for every parameter (the
    trainable ones only without `with_frozen`) and persistent buffer, `optimizer/<name>/<key>` for every
    optimizer state tensor."""
    parameters = dict(model.named_parameters()) if with_frozen else _trainable_named_parameters(model)
    tensors = {f"model/{name}": param.detach() for name, param in parameters.items()}
    tensors.update({f"model/{name}": buffer for name, buffer in persistent_buffers(model).items()})
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
    tensors = checkpoint_tensors(model, optimizer, save_frozen)
    save = _CheckpointSave(out_dir, step, model, optimizer, tensors, trainer_state, rank_state)
    checksums: dict[str, str] = {}
    try:
        checksums = save_sharded(tensors, save.partial / SHARDS_DIR, save.rank_checksums)
        error = None
    except Exception as err:  # DCP hands back the failing rank's own exception, on every rank
        error = err
    fault_point(f"save_{step}_shards_written", save.rank)
    save.fail_together(error)  # also the barrier: every rank's files are on disk
    save.fail_together(save.publish(checksums))  # also the barrier: nobody moves on before it is published
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
                error = self.save.publish(written.result())
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
    tensors = checkpoint_tensors(model, optimizer, save_frozen)
    save = _CheckpointSave(out_dir, step, model, optimizer, tensors, trainer_state, rank_state)
    written = save_sharded_in_background(
        tensors,
        save.partial / SHARDS_DIR,
        process_group,
        before_write=lambda: fault_point(f"save_{step}_writing_in_background", save.rank),
        stager=stager,
        checksums=save.rank_checksums,
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
        tensors: dict[str, torch.Tensor],
        trainer_state: dict[str, Any],
        rank_state: dict[str, Any],
    ) -> None:
        self.out_dir, self.step, self.rank = out_dir, step, global_rank()
        # What `litsft plan` prints as a step checkpoint's size on disk (tests/test_training_plan.py holds the
        # two equal); the rank files and headers add a few kB.
        self.tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
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
        self.rank_checksums: dict[str, str] = {}
        """This rank's own files besides its shard, by name, with their checksums."""
        try:
            fault_point(f"save_{step}_writing", self.rank)
            self.rank_checksums = _write_rank_state(self.partial, self.rank, rank_state)
        except OSError as err:
            error = err
        # Before DCP's save, which is collective: a rank that failed already must not leave the others in it.
        self.fail_together(error)

    def fail_together(self, error: BaseException | None) -> None:
        failure = first_message(self._why(error))
        if failure is not None:
            if self.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)
            failed_rank, message = failure
            kept = f"{self.previous.name} is intact" if self.previous else "no earlier checkpoint exists"
            raise LitsftError(
                f"could not write checkpoint {self.final} (rank {failed_rank}: {message}); {kept}: free disk "
                "space or fix permissions, then relaunch the same command to resume"
            )

    def _why(self, error: BaseException | None) -> str:
        """This rank's failure in a few words ("" for none); a full disk also says what the checkpoint needs
        there and what was free when the write failed (the bare ENOSPC says neither)."""
        if error is None:
            return ""
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            try:
                free = f"{readable_size(shutil.disk_usage(self.out_dir).free)} was free"
            except OSError:
                free = "the free space is unknown"
            return (
                f"{first_line(error)}; a step checkpoint of this run takes {readable_size(self.tensor_bytes)} "
                f"on the disk of {self.out_dir}, where {free}"
            )
        return first_line(error)

    def publish(self, checksums: dict[str, str]) -> OSError | None:
        """On rank 0, once every rank's files are on disk: trainer_state.json listing them with their sizes
        and `checksums` (every rank's, gathered by the save), then the rename."""
        if self.rank != 0:
            return None
        try:
            partial = self.partial
            files = {str(p.relative_to(partial)): p.stat().st_size for p in partial.rglob("*") if p.is_file()}
            state = dict(
                self.trainer_state,
                files=sorted(files),
                file_sizes=files,
                file_checksums={name: checksums[name] for name in sorted(files) if name in checksums},
            )
            write_json(partial / TRAINER_STATE, state, durable=True)
            fault_point(f"save_{self.step}_before_rename", self.rank)
            os.replace(partial, self.final)
            fsync_path(self.out_dir)
        except OSError as err:
            return err
        return None


RANK_STATE_KEY = "litsft_rank_state"
"""The metadata key of a rank file's header holding, as JSON, its state with each tensor named in its place."""


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _write_rank_state(partial: Path, rank: int, rank_state: dict[str, Any]) -> dict[str, str]:
    """This rank's own state (RNG, data loader, loss scale), fsynced: its tensors in a safetensors file,
    everything else as JSON in that file's header, so that reading it unpickles nothing. Returns the file's
    checksum by name."""
    tensors: dict[str, torch.Tensor] = {}
    text = json.dumps(_tensors_named(rank_state, "", tensors))
    data = safetensors_bytes(tensors, metadata={RANK_STATE_KEY: text})
    name = rank_file_name(rank)
    return {name: write_bytes(partial / name, data, durable=True)}


_TENSOR, _TUPLE = "__tensor__", "__tuple__"


def _tensors_named(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON: each tensor moved to `tensors` under its path and named in its place, each tuple
    marked as one (Python's random.setstate takes tuples only)."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous()
        return {_TENSOR: path}
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"rank state {path or '<root>'} has a key that is not a string")
        return {
            key: _tensors_named(item, f"{path}.{key}" if path else key, tensors)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        items = [_tensors_named(item, f"{path}.{i}", tensors) for i, item in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"rank state {path} is a {type(value).__name__}, which a checkpoint does not store")


def _tensors_in_place(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """`_tensors_named` undone."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_TUPLE}:
            return tuple(_tensors_in_place(item, tensors) for item in value[_TUPLE])
        return {key: _tensors_in_place(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_tensors_in_place(item, tensors) for item in value]
    return value


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
    targets = {f"model/{name}": param.data for name, param in parameters.items()}
    targets.update({f"model/{name}": buffer for name, buffer in persistent_buffers(model).items()})
    missing = sorted(name.removeprefix("model/") for name in targets if name not in stored)
    if missing:
        raise LitsftError(
            f"{checkpoint_dir} has no weights for {missing[:3]}; it was written for a different model"
        )
    optimizer_state = _empty_optimizer_state(checkpoint_dir, state["param_groups"], model, optimizer, stored)
    for name, param_state in optimizer_state.items():
        targets.update({f"optimizer/{name}/{key}": value for key, value in param_state.items()})
    reader.load(targets)
    param_of = dict(model.named_parameters())
    for name, param_state in optimizer_state.items():
        optimizer.state[param_of[name]] = param_state
    rank_state = None
    if state["world_size"] == world_size():
        rank_state = load_rank_state(checkpoint_dir, global_rank())
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
    return load_rank_state(checkpoint_dir, 0)


def load_rank_state(checkpoint_dir: Path, rank: int) -> dict[str, Any]:
    """A rank's RNG and data-loader state, from its safetensors file (its header's JSON, its tensors put in
    place), or from the `rank-XXXXX.pt` of a checkpoint written before those (`load_legacy_rank_state`)."""
    path = checkpoint_dir / rank_file_name(rank)
    legacy = checkpoint_dir / f"rank-{rank:05d}.pt"
    if not path.exists() and legacy.exists():
        return load_legacy_rank_state(legacy)
    fix = f"the file is damaged; {_fix_for_damaged(checkpoint_dir)}"
    tensors, metadata = load_safetensors_and_metadata(path, fix)
    try:
        return _tensors_in_place(json.loads(metadata[RANK_STATE_KEY]), tensors)
    except (KeyError, ValueError, TypeError) as err:
        raise LitsftError(f"{path} holds no rank state ({first_line(err)}); {fix}") from None


def load_legacy_rank_state(path: Path) -> dict[str, Any]:
    """A `rank-XXXXX.pt` of a checkpoint written before rank files were safetensors, so that a run survives an
    upgrade of litsft. weights_only=True: torch's restricted unpickler rebuilds tensors and plain data and
    refuses every other global, so unpickling it runs no code."""
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
