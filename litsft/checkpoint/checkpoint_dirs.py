"""The step checkpoints in an out_dir, as directories: their names, whether one is complete, which one a
run resumes from, and the trainer_state.json each carries.

Plain files, no torch: the checks before launch (litsft.cli.validation) read them before torch or Lightning
is imported. Writing and loading checkpoints is litsft.checkpoint.training_checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litsft.errors import LitsftError
from litsft.runtime.files import read_json

STEP_PREFIX = "step-"
FINAL_DIR = "final"
"""The out_dir folder holding the finished model."""
PARTIAL_SUFFIX = ".partial"
"""A checkpoint being written is `.step-XXXXXXXX.partial/` until it is complete."""
DELETING_SUFFIX = ".deleting"
"""An old checkpoint being deleted is renamed `.step-XXXXXXXX.deleting/` first."""
TRAINER_STATE = "trainer_state.json"
"""Written last: step, config and the list of every file with its size."""


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def is_complete(checkpoint_dir: Path) -> bool:
    state_path = checkpoint_dir / TRAINER_STATE
    if not state_path.is_file():
        return False
    try:
        state = read_json(state_path)
        files, sizes = state["files"], state.get("file_sizes", {})
        # A damaged trainer_state.json (a list where a dict belongs, a number for a name) is incomplete too.
        return all(
            (checkpoint_dir / name).is_file()
            and (name not in sizes or (checkpoint_dir / name).stat().st_size == sizes[name])
            for name in files
        )
    except (LitsftError, KeyError, TypeError):
        return False


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
    return read_json(checkpoint_dir / TRAINER_STATE)
