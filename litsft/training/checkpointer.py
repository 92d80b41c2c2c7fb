"""What a training checkpoint holds, and the component that saves and restores it.

`TrainState` is everything the loop changes besides the learning-rate schedule: step, epoch, the model, the
optimizer, the training loader's position and, under 16-mixed, the loss scale. `Checkpointer.save` writes it
(with the run's config and this rank's random streams) through `litsft.checkpoint.training_checkpoint`;
`Checkpointer.load` restores it in place, also into a different number of ranks. With `--train.async_save`
(on by default for GPU runs whose host memory holds the copies: `background_saves_fit`) a save returns once
the state is copied to host memory and the files are written in the background; the next save, `finish`
and a stop signal's save wait for it first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from litsft.checkpoint import training_checkpoint as checkpoint
from litsft.checkpoint.checkpoint_dirs import (
    FROZEN_BASE,
    FROZEN_FINGERPRINT,
    TOKENIZER_DIR,
    VALIDATION_PROMPTS,
    read_trainer_state,
)
from litsft.checkpoint.model_folder import read_manifest
from litsft.checkpoint.sharded_tensors import first_message, local_bytes, pinned_stager
from litsft.errors import LitsftError
from litsft.runtime.faults import fault_point
from litsft.runtime.host_memory import available_host_memory
from litsft.training.args import RunConfig, describe, on_cuda_by_default


@dataclass
class TrainState:
    """The state of a run between two optimizer steps."""

    model: Any
    """The model as Fabric wraps it (`model.module` is the model itself, with its own parameter names)."""
    optimizer: torch.optim.Optimizer
    train_loader: Any
    step: int = 0
    epoch: int = 0
    skipped_steps: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """Steps whose update was skipped for an inf/NaN gradient norm, counted on the device (the loop
    reads it only where it waits for the device anyway). Not checkpointed: a save happens only after the
    loop has checked that it is zero."""
    loss_scaler: torch.amp.GradScaler | None = None
    """The GradScaler of 16-mixed (None under every other precision). Its scale is found during training
    (halved on each overflow, doubled after `growth_interval` clean steps); a resume that started it again
    from its initial value would skip updates the uninterrupted run makes."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the state that is not a tensor of the model or optimizer."""
        state = {"step": self.step, "epoch": self.epoch, "loader": self.train_loader.state_dict()}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()  # plain numbers: scale, growth tracker
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = state["step"], state["epoch"]
        self.train_loader.set_epoch(self.epoch)
        self.train_loader.load_state_dict(state["loader"])
        # A checkpoint written under another precision has no scale to continue from: the scaler starts as new.
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


class Checkpointer:
    """Saves and restores a TrainState under `run.out_dir` (collective: every rank calls save and load)."""

    def __init__(
        self,
        fabric: Any,
        run: RunConfig,
        recipe_name: str,
        save_frozen: bool,
        frozen_base: Path | None = None,
        validation_prompts: list[list[dict[str, str]]] | None = None,
    ) -> None:
        self.fabric, self.run, self.recipe_name = fabric, run, recipe_name
        self.validation_prompts = validation_prompts or []
        """The run's prompts for `convert_to_hf --check`, recorded in each checkpoint as final/ keeps them."""
        self.save_frozen = save_frozen
        """Whether checkpoints hold frozen parameters too (LoRA: no, the base is loaded again)."""
        self.frozen_base = frozen_base
        recorded = read_manifest(frozen_base).get("weights_sha256") if frozen_base is not None else None
        self.frozen_fingerprint = recorded if isinstance(recorded, str) else None
        """The fingerprint of the frozen weights checkpoints leave out (LoRA's base), recorded in each one: a
        resume over other weights would continue adapters trained on one base over another. Read from the
        base's manifest (a folder without one, written by an earlier litsft, is not read whole for it)."""
        self.pending: checkpoint.BackgroundSave | None = None
        """The background save still being written, if any."""
        self.in_background = bool(run.train.save_interval) and on_cuda_by_default(
            run.train.async_save, fabric.device.type
        )
        """Whether step checkpoints (every --train.save_interval steps) are written in the background; a
        default of on is checked against the host memory at the first save. A run without them needs no gloo
        group for background writes (a stop signal's checkpoint is written synchronously)."""
        self.check_memory = self.in_background and run.train.async_save is None
        self.stager = None
        """A GPU's page-locked staging buffers, kept from the first background save to `close`."""
        self.background_group = None
        if self.in_background and fabric.world_size > 1:
            import torch.distributed as dist

            # The background writes' own collectives, on a CPU group of their own: on training's group
            # they could interleave with the step's all-gathers and reduce-scatters from another thread.
            self.background_group = dist.new_group(backend="gloo")

    def save(self, state: TrainState, wait: bool = False) -> Path:
        """Checkpoint `state`; in the background under --train.async_save unless `wait`."""
        self.finish()
        out_dir, step = self.run.out_dir, state.step
        trainer_state = {
            "epoch": state.epoch,
            "recipe": self.recipe_name,
            "seed": self.run.seed,
            "config": asdict(self.run.config),
            "arguments": describe(self.run.cli_arguments),
            "data": self.run.data.fingerprint(),
        }
        # Where the files final/ takes from outside the run come from, so that a step checkpoint opens as
        # the model final/ would hold at its step (litsft.checkpoint.step_model).
        if self.run.tokenizer_dir is not None:
            trainer_state[TOKENIZER_DIR] = str(Path(self.run.tokenizer_dir).resolve())
        if self.frozen_base is not None:
            trainer_state[FROZEN_BASE] = str(Path(self.frozen_base).resolve())
        if self.frozen_fingerprint is not None:
            trainer_state[FROZEN_FINGERPRINT] = self.frozen_fingerprint
        if self.validation_prompts:
            trainer_state[VALIDATION_PROMPTS] = self.validation_prompts
        rank_state = {"rng": checkpoint.rng_state(), **state.state_dict()}
        what = (out_dir, step, state.model.module, state.optimizer, trainer_state, rank_state)
        if self.check_memory:
            self.check_memory = False
            self.in_background = self._background_saves_fit(state)
        if self.in_background and not wait:
            if self.stager is None and self.fabric.device.type == "cuda":
                self.stager = pinned_stager()
            self.pending = checkpoint.start_background_save(
                *what,
                save_frozen=self.save_frozen,
                process_group=self.background_group,
                keep_last=self.run.train.keep_last,
                stager=self.stager,
            )
            return self.pending.final
        path = checkpoint.save_training_checkpoint(*what, save_frozen=self.save_frozen)
        fault_point(f"save_{step}_after_rename", self.fabric.global_rank)
        checkpoint.rotate_checkpoints(out_dir, self.run.train.keep_last)
        self.fabric.print(f"Saved checkpoint {path}")
        return path

    def _check_frozen_base(self, path: Path) -> None:
        """Refuse to resume over frozen weights other than those the checkpoint was trained over (checkpoints
        written before the fingerprint was recorded are taken as they are)."""
        recorded = read_trainer_state(path).get(FROZEN_FINGERPRINT)
        if self.frozen_fingerprint is None or recorded is None or recorded == self.frozen_fingerprint:
            return
        raise LitsftError(
            f"{path} was trained over other frozen base weights than {self.frozen_base} holds (fingerprint "
            f"{self.frozen_fingerprint[:12]}, recorded {recorded[:12]}); resume with the base checkpoint it "
            "was trained over, or pass another --out_dir to start over"
        )

    def finish(self) -> None:
        """Wait for the background save, if one is being written, to be published. Collective."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            path = pending.wait()
            fault_point(f"save_{pending.save.step}_after_rename", self.fabric.global_rank)
            self.fabric.print(f"Saved checkpoint {path}")

    def close(self) -> None:
        """`finish`, then release the staging buffers (before the final model needs host memory). Collective."""
        self.finish()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _background_saves_fit(self, state: TrainState) -> bool:
        """Whether every rank's node holds its processes' host copies of a checkpoint twice over; if one does
        not, every rank saves synchronously and the run says why. Collective."""
        tensors = checkpoint.checkpoint_tensors(state.model.module, state.optimizer, self.save_frozen)
        reason = background_saves_fit(local_bytes(tensors), self.run.devices, available_host_memory())
        refusal = first_message(reason or "")
        if refusal is not None:
            rank, reason = refusal
            self.fabric.print(
                f"Checkpoints are written synchronously: {reason} (rank {rank}); --train.async_save true "
                "writes them in the background anyway"
            )
        return refusal is None

    def load(self, path: Path, state: TrainState) -> None:
        fabric = self.fabric
        self._check_frozen_base(path)
        trainer_state, rank_state = checkpoint.load_training_checkpoint(
            path, state.model.module, state.optimizer, load_frozen=self.save_frozen
        )
        step = trainer_state["step"]
        if rank_state is None:
            # A different number of ranks: weights and optimizer state were resharded; data order does not
            # depend on the world size; only the per-rank random streams (dropout) cannot continue, so they
            # are reseeded.
            fabric.print(resharding_notice(path, trainer_state["world_size"], fabric.world_size))
            rank_state = checkpoint.load_rank_zero_state(path)
            torch.manual_seed(self.run.seed + step * 7919 + fabric.global_rank)
        else:
            checkpoint.set_rng_state(rank_state["rng"])
        state.load_state_dict({**rank_state, "step": step})
        fabric.print(f"Resumed from {path} at step {step}")


def background_saves_fit(
    staged_bytes: int, processes_per_node: int, available_bytes: int | None
) -> str | None:
    """Why a node cannot keep its processes' host copies of a checkpoint (`staged_bytes` each) for background
    saves, or None if they take at most half of its available memory (the data loaders' workers and the
    final model folder need the rest) or the system does not say what is available."""
    node_bytes = staged_bytes * processes_per_node
    if available_bytes is None or 2 * node_bytes <= available_bytes:
        return None
    return (
        f"a background save would keep {node_bytes / 1e9:.1f} GB of host memory ({processes_per_node} x "
        f"{staged_bytes / 1e9:.1f} GB) and {available_bytes / 1e9:.1f} GB is available"
    )


def resharding_notice(path: Path, written_by: int, world_size: int) -> str:
    """What a resume on another number of processes than the checkpoint's says."""
    return (
        f"Resuming {path} (written by {written_by} process{'es' if written_by != 1 else ''}) on {world_size}: "
        "random streams are reseeded, so dropout differs from an uninterrupted run."
    )
