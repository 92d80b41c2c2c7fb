"""litsft/checkpoint/checkpoint_dirs.py, on plain directories written here (no torch): checkpoint names, what
makes one complete, which one a run resumes from (the newest complete one; partial, damaged, misnamed and
deleting ones never), and reading its trainer_state.json. Checkpoints written by the real saver are in
tests/test_checkpoint_training_checkpoint.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from litsft.checkpoint.checkpoint_dirs import (
    TRAINER_STATE,
    checkpoint_name,
    is_complete,
    latest_checkpoint,
    read_trainer_state,
    resume_checkpoint,
)
from litsft.errors import LitsftError


def write_checkpoint(directory: Path, files: dict[str, bytes], state: object = None) -> Path:
    """A checkpoint directory holding `files`, and a trainer_state.json listing them with their sizes."""
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    if state is None:
        state = {"step": 1, "files": list(files), "file_sizes": {name: len(c) for name, c in files.items()}}
    (directory / TRAINER_STATE).write_text(json.dumps(state))
    return directory


def test_checkpoint_names_sort_by_step() -> None:
    assert checkpoint_name(7) == "step-00000007"
    assert checkpoint_name(12345678) == "step-12345678"
    names = [checkpoint_name(step) for step in (100, 9, 10)]
    assert sorted(names) == [checkpoint_name(9), checkpoint_name(10), checkpoint_name(100)]


def test_a_checkpoint_is_complete_only_with_every_listed_file_at_its_size(tmp_path: Path) -> None:
    files = {"model.safetensors": b"12345", "shards/rank-0.safetensors": b"abc"}
    checkpoint = write_checkpoint(tmp_path / "ckpt", files)
    assert is_complete(checkpoint)
    (checkpoint / "shards" / "rank-0.safetensors").write_bytes(b"ab")  # truncated
    assert not is_complete(checkpoint)
    (checkpoint / "shards" / "rank-0.safetensors").unlink()  # missing
    assert not is_complete(checkpoint)
    # A file listed without a size counts when it exists.
    assert is_complete(write_checkpoint(tmp_path / "unsized", files, {"files": list(files)}))


@pytest.mark.parametrize(
    "state",
    [
        "{broken",
        "[]",
        '{"step": 3}',
        '{"files": 5}',
        '{"files": [5]}',
        '{"files": ["a"], "file_sizes": ["a"]}',
    ],
)
def test_an_unreadable_or_incomplete_trainer_state_makes_a_checkpoint_incomplete(
    tmp_path: Path, state
) -> None:
    (tmp_path / "a").write_text("1")
    (tmp_path / TRAINER_STATE).write_text(state)
    assert not is_complete(tmp_path)
    assert not is_complete(tmp_path / "nothing-here")


def test_the_latest_checkpoint_is_the_newest_complete_one(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    assert latest_checkpoint(out_dir) is None  # no out_dir yet
    out_dir.mkdir()
    assert latest_checkpoint(out_dir) is None
    for step in (2, 10, 9):
        write_checkpoint(out_dir / checkpoint_name(step), {"model.safetensors": b"x"})
    assert latest_checkpoint(out_dir) == out_dir / checkpoint_name(10)
    # Newer ones that are not complete step checkpoints are passed over.
    (out_dir / checkpoint_name(12)).mkdir()  # being written by a crashed run, no trainer_state.json
    write_checkpoint(out_dir / f".{checkpoint_name(14)}.partial", {"model.safetensors": b"x"})
    write_checkpoint(out_dir / f".{checkpoint_name(16)}.deleting", {"model.safetensors": b"x"})
    write_checkpoint(out_dir / "step-final", {"model.safetensors": b"x"})
    (out_dir / checkpoint_name(18)).write_text("a file, not a directory")
    damaged = write_checkpoint(out_dir / checkpoint_name(20), {"model.safetensors": b"xy"})
    (damaged / "model.safetensors").write_bytes(b"x")
    assert latest_checkpoint(out_dir) == out_dir / checkpoint_name(10)


def test_resume_picks_the_newest_a_given_directory_or_none(tmp_path: Path) -> None:
    newest = write_checkpoint(tmp_path / checkpoint_name(3), {"a": b"1"})
    write_checkpoint(tmp_path / checkpoint_name(1), {"a": b"1"})
    assert resume_checkpoint("auto", tmp_path) == resume_checkpoint(True, tmp_path) == newest
    assert resume_checkpoint(False, tmp_path) is None and resume_checkpoint(None, tmp_path) is None
    given = tmp_path / checkpoint_name(1)
    assert resume_checkpoint(str(given), tmp_path) == given
    missing = tmp_path / checkpoint_name(9)
    with pytest.raises(
        LitsftError,
        match=rf"^--resume {missing}: no such checkpoint directory; pass an existing step-XXXXXXXX dir or auto$",
    ):
        resume_checkpoint(missing, tmp_path)


def test_the_trainer_state_of_a_complete_checkpoint_only(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / checkpoint_name(5), {"a": b"1"})
    state = read_trainer_state(checkpoint)
    assert state == {"step": 1, "files": ["a"], "file_sizes": {"a": 1}}
    (checkpoint / "a").unlink()
    with pytest.raises(LitsftError, match=r"is not a complete litsft training checkpoint .*--resume auto$"):
        read_trainer_state(checkpoint)
