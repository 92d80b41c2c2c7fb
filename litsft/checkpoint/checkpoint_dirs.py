"""The step checkpoints in an out_dir, as directories: their names, whether one is complete (and how one is
damaged: `find_damage`), damaged ones moved aside, which one a run resumes from, the trainer_state.json
each carries, and what to say when a run's out_dir is given where a model is read (a step checkpoint is
one: `litsft.checkpoint.step_model`).

Plain files, no torch: the checks before launch (litsft.cli.validation) read them before torch or Lightning
is imported. Writing and loading checkpoints is litsft.checkpoint.training_checkpoint's.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from litsft.errors import LitsftError
from litsft.model.config import CONFIG_FILENAME, Config
from litsft.runtime.files import checksum_of_file, read_json

STEP_PREFIX = "step-"
FINAL_DIR = "final"
"""The out_dir folder holding the finished model."""
PARTIAL_SUFFIX = ".partial"
"""A checkpoint being written is `.step-XXXXXXXX.partial/` until it is complete."""
DELETING_SUFFIX = ".deleting"
"""An old checkpoint being deleted is renamed `.step-XXXXXXXX.deleting/` first."""
TRAINER_STATE = "trainer_state.json"
"""Written last: step, config and the list of every file with its size and checksum."""
FROZEN_FINGERPRINT = "frozen_weights_sha256"
"""trainer_state.json's fingerprint of the frozen weights a checkpoint leaves out (finetune_lora's base)."""
FROZEN_BASE = "frozen_base"
"""trainer_state.json's model folder those frozen weights are read from, as an absolute path."""
TOKENIZER_DIR = "tokenizer_dir"
"""trainer_state.json's folder the run's tokenizer files come from (copied into final/), as an absolute path."""
VALIDATION_PROMPTS = "validation_prompts"
"""trainer_state.json's first validation conversations of the run, up to their first reply, which final/ keeps
in VALIDATION_PROMPTS_FILE (the prompts `convert_to_hf --check` asks an export)."""
VALIDATION_PROMPTS_FILE = "validation_prompts.json"
CHECKPOINT_FORMAT = "dcp-safetensors"
"""trainer_state.json's `format`: tensors written by torch.distributed.checkpoint's Hugging Face safetensors
storage. Checkpoints without it were written in litsft's earlier format (rows and their offsets, per rank)."""


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


DAMAGED_INFIX = ".damaged-"
"""A damaged checkpoint is moved aside to `step-XXXXXXXX.damaged-<UTC time>/`, kept as evidence."""


def find_damage(checkpoint_dir: Path, contents: bool = False) -> str | None:
    """How a published checkpoint directory differs from what was written into it, in a few words (None: it
    is intact). `trainer_state.json`, written last, lists every other file with its size and checksum: a
    listed file missing or of another size, or a file it does not list, is damage; with `contents`, so is a
    file whose bytes no longer have their checksum (this reads every file: a second per few GB)."""
    state_path = checkpoint_dir / TRAINER_STATE
    if not state_path.is_file():
        return f"{TRAINER_STATE} is missing"
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"{TRAINER_STATE} is not valid JSON ({err})"
    # A damaged trainer_state.json (a list where a dict belongs, a number for a name) is damage too.
    files, sizes = (
        (state.get("files"), state.get("file_sizes", {})) if isinstance(state, dict) else (None, None)
    )
    if (
        not isinstance(files, list)
        or not all(isinstance(n, str) for n in files)
        or not isinstance(sizes, dict)
    ):
        return f"{TRAINER_STATE} has no list of the checkpoint's files"
    for name in files:
        path = checkpoint_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size, written = path.stat().st_size, sizes.get(name)
        if written is not None and size != written:
            how = "truncated" if size < written else "longer than written"
            return f"{name} is {how} ({size:,} of {written:,} bytes)"
    present = {str(p.relative_to(checkpoint_dir)) for p in checkpoint_dir.rglob("*") if p.is_file()}
    extra = sorted(present - set(files) - {TRAINER_STATE})
    if extra:
        return f"{extra[0]} is not a file it was written with" + (
            f" (nor are {len(extra) - 1} more)" if len(extra) > 1 else ""
        )
    checksums = state.get("file_checksums", {})  # none in checkpoints written before litsft recorded them
    if contents and isinstance(checksums, dict):
        for name in files:
            written = checksums.get(name)
            if isinstance(written, str) and checksum_of_file(checkpoint_dir / name) != written:
                return f"{name} does not hold the bytes it was written with (its checksum differs)"
    return None


def is_complete(checkpoint_dir: Path) -> bool:
    return find_damage(checkpoint_dir) is None


def step_checkpoints(out_dir: Path) -> list[Path]:
    """The `step-XXXXXXXX` directories in out_dir, oldest first, complete or not."""
    if not out_dir.is_dir():
        return []
    return sorted(
        p for p in out_dir.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name[len(STEP_PREFIX) :].isdigit()
    )


def complete_checkpoints_after(out_dir: Path, step: int) -> list[Path]:
    """The complete checkpoints in out_dir of steps after `step`, oldest first (damaged ones are moved aside
    before a run starts: `set_aside_damaged_checkpoints`)."""
    return [p for p in step_checkpoints(out_dir) if int(p.name[len(STEP_PREFIX) :]) > step and is_complete(p)]


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete `step-*` checkpoint in out_dir; partial or damaged ones are never picked."""
    for candidate in reversed(step_checkpoints(out_dir)):
        if is_complete(candidate):
            return candidate
    return None


def set_aside_damaged_checkpoints(out_dir: Path) -> list[str]:
    """Move every damaged `step-XXXXXXXX` checkpoint of out_dir aside (renamed, never deleted: it is evidence
    of what went wrong) and return one line per checkpoint, oldest first, saying how it was damaged and where
    it went. A run then resumes from the newest intact checkpoint and saves that step again under its own
    name. The checkpoint a run would resume from has its files' checksums checked too (the older ones only
    their sizes: reading every checkpoint whole would cost a relaunch minutes), so a damaged newest one
    gives way to the one before, which is checked the same way. Call it on one process, before any process
    looks for the checkpoint to resume from."""
    notices = []
    verified = False
    for checkpoint in reversed(step_checkpoints(out_dir)):
        damage = find_damage(checkpoint, contents=not verified)
        if damage is None:
            verified = True
            continue
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        aside = checkpoint.with_name(f"{checkpoint.name}{DAMAGED_INFIX}{stamp}")
        for attempt in range(2, 100):
            if not aside.exists():
                break
            aside = checkpoint.with_name(f"{checkpoint.name}{DAMAGED_INFIX}{stamp}-{attempt}")
        os.replace(checkpoint, aside)
        notices.append(f"checkpoint {checkpoint} is damaged: {damage}; moved it aside to {aside.name}")
    return notices[::-1]


def resume_checkpoint(resume: bool | str | Path, out_dir: Path) -> Path | None:
    """The checkpoint a run resumes from: the newest complete one in out_dir ("auto"/true), a given
    directory, or none (false)."""
    if resume is False or resume is None:
        return None
    if resume in ("auto", True):
        return latest_checkpoint(out_dir)
    path = Path(resume)
    if not path.exists():
        raise LitsftError(
            f"--resume {path}: no such checkpoint directory; pass an existing step-XXXXXXXX dir or auto"
        )
    if not path.is_dir():
        raise LitsftError(f"--resume {path} is a file; pass a step-XXXXXXXX checkpoint directory or auto")
    if not (path / TRAINER_STATE).exists() and not path.name.startswith(STEP_PREFIX):
        _refuse_what_is_no_checkpoint(path)
    return path


def _refuse_what_is_no_checkpoint(path: Path) -> None:
    """--resume given a folder users mistake for a checkpoint: a run's out_dir, or a model folder (its
    final/, a base checkpoint, a Hugging Face folder). A folder of neither kind is left to the checks of
    `read_trainer_state`, which say what it lacks."""
    if step_checkpoints(path):
        newest = latest_checkpoint(path)
        which = f"pass {newest}, its newest complete one, or" if newest is not None else "pass"
        raise LitsftError(
            f"--resume {path} is a run's out_dir, not one of its step checkpoints; {which} "
            f"`--out_dir {path} --resume auto` to continue that run there"
        )
    if any((path / name).exists() for name in MODEL_FOLDER_FILES):
        raise LitsftError(
            f"--resume {path} is a model folder, not a training checkpoint (it has no {TRAINER_STATE}); "
            "--resume takes a step-XXXXXXXX dir of an earlier run: to train this model further, pass it as "
            "the checkpoint to start from, with another --out_dir"
        )


MODEL_FOLDER_FILES = (CONFIG_FILENAME, "config.json")
"""A litsft model folder's config and a Hugging Face folder's."""


def is_step_checkpoint(path: Path) -> bool:
    """Whether `path` is a step checkpoint (complete or not): a folder with a trainer_state.json."""
    return (path / TRAINER_STATE).is_file()


STEP_MODEL_RECIPES = ("finetune_full", "pretrain", "finetune_lora")
"""The recipes whose step checkpoints open as a model (trainer_state.json's `recipe`)."""


def step_model_state(step_dir: Path, contents: bool = False) -> dict[str, Any]:
    """The trainer_state.json of a step checkpoint given as a model, refused in one line when the checkpoint
    is incomplete or damaged (with `contents`, also when a file's bytes no longer have their checksum), of an
    earlier format, or of a recipe whose steps hold no model."""
    damage = find_damage(step_dir, contents=contents)
    if damage is not None:
        raise LitsftError(
            f"{step_dir} is not a complete step checkpoint ({damage}), so it holds no model; pass another "
            "step checkpoint of that run, or its final/"
        )
    state = read_json(step_dir / TRAINER_STATE, fix="pass another step checkpoint of that run")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise LitsftError(
            f"{step_dir} is a step checkpoint in litsft's earlier row-sharded format, which this version no "
            "longer reads; pass another step checkpoint of that run, or its final/"
        )
    if state.get("recipe") not in STEP_MODEL_RECIPES or not isinstance(state.get("config"), dict):
        raise LitsftError(
            f"{step_dir}/{TRAINER_STATE} names none of {', '.join(STEP_MODEL_RECIPES)} with its model config, "
            "so the checkpoint cannot be read as a model; pass another step checkpoint of that run, or its final/"
        )
    return state


def step_model_config(step_dir: Path) -> Config:
    """The config of a step checkpoint's model (for finetune_lora, its base's), without reading a weight."""
    return Config.from_values(step_model_state(step_dir)["config"], step_dir / TRAINER_STATE)


def out_dir_given_as_a_model(path: Path) -> str | None:
    """The line for a command that reads a model (training's starting point, convert_to_hf, generate) given
    a run's out_dir instead: the model in it to pass. None for a folder of another kind."""
    if (path / FINAL_DIR).is_dir():
        return f"{path} is a run's out_dir; pass {path / FINAL_DIR}, the model it finished with"
    newest = latest_checkpoint(path)
    if newest is not None:
        return (
            f"{path} is the out_dir of a run that has not finished (no {FINAL_DIR}/ yet); pass {newest}, the "
            "model of its newest step checkpoint, or relaunch that run to finish it"
        )
    return None


def read_trainer_state(checkpoint_dir: Path) -> dict[str, Any]:
    damage = find_damage(checkpoint_dir)
    if damage is not None:
        raise LitsftError(
            f"{checkpoint_dir} is not a complete litsft training checkpoint ({damage}); pass another one or "
            "--resume auto"
        )
    state = read_json(checkpoint_dir / TRAINER_STATE)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise LitsftError(
            f"{checkpoint_dir} is in litsft's earlier row-sharded checkpoint format, which this version no longer "
            "reads; finish that run with the litsft that wrote it, or start this one in another --out_dir"
        )
    return state
