"""litsft/checkpoint/checkpoint_dirs.py, on plain directories written here (no torch): checkpoint names, what
makes one complete, which one a run resumes from (the newest complete one; partial, damaged, misnamed and
deleting ones never), and reading its trainer_state.json. Checkpoints written by the real saver are in
tests/test_checkpoint_training_checkpoint.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from litsft.checkpoint.checkpoint_dirs import (
    CHECKPOINT_FORMAT,
    TRAINER_STATE,
    checkpoint_name,
    complete_checkpoints_after,
    find_damage,
    is_complete,
    is_step_checkpoint,
    latest_checkpoint,
    out_dir_given_as_a_model,
    read_trainer_state,
    resume_checkpoint,
    set_aside_damaged_checkpoints,
    step_model_config,
    step_model_state,
)
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.runtime.files import checksum_of_file


def write_checkpoint(directory: Path, files: dict[str, bytes], state: object = None) -> Path:
    """A checkpoint directory holding `files`, and a trainer_state.json listing them with their sizes and
    checksums."""
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    if state is None:
        sizes = {name: len(c) for name, c in files.items()}
        checksums = {name: checksum_of_file(directory / name) for name in files}
        state = {
            "step": 1,
            "format": CHECKPOINT_FORMAT,
            "files": list(files),
            "file_sizes": sizes,
            "file_checksums": checksums,
        }
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


def test_the_complete_checkpoints_after_a_step(tmp_path: Path) -> None:
    steps = {step: write_checkpoint(tmp_path / checkpoint_name(step), {"a": b"1"}) for step in (2, 4, 6)}
    (steps[6] / "a").write_bytes(b"")  # damaged: moved aside before a run starts
    assert complete_checkpoints_after(tmp_path, 2) == [steps[4]]
    assert complete_checkpoints_after(tmp_path, 4) == [] == complete_checkpoints_after(tmp_path / "none", 0)


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


def test_resume_given_a_file_an_out_dir_or_a_model_folder_says_what_it_was_given(tmp_path: Path) -> None:
    """What users pass to --resume instead of a step checkpoint: each refused with the line naming what it
    is and what to pass, before anything is read as a checkpoint."""
    out_dir = tmp_path / "run"
    newest = write_checkpoint(out_dir / checkpoint_name(4), {"a": b"1"})
    write_checkpoint(out_dir / checkpoint_name(2), {"a": b"1"})
    state_file = newest / "trainer_state.json"
    with pytest.raises(
        LitsftError, match=rf"^--resume {state_file} is a file; pass a step-XXXXXXXX checkpoint"
    ):
        resume_checkpoint(state_file, tmp_path / "new")
    with pytest.raises(
        LitsftError,
        match=rf"^--resume {out_dir} is a run's out_dir, not one of its step checkpoints; pass {newest}, its "
        rf"newest complete one, or `--out_dir {out_dir} --resume auto` to continue that run there$",
    ):
        resume_checkpoint(out_dir, tmp_path / "new")
    for config in ("litsft_config.json", "config.json"):  # a finished run's final/, a Hugging Face folder
        model = tmp_path / f"model-with-{config}"
        model.mkdir()
        (model / config).write_text("{}")
        with pytest.raises(
            LitsftError, match=rf"^--resume {model} is a model folder, not a training checkpoint"
        ):
            resume_checkpoint(model, tmp_path / "new")
    assert resume_checkpoint(newest, tmp_path / "new") == newest


def test_an_out_dir_given_as_a_model_is_named_with_the_model_to_pass(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    step = write_checkpoint(out_dir / checkpoint_name(4), {"a": b"1"})
    assert out_dir_given_as_a_model(out_dir) == (
        f"{out_dir} is the out_dir of a run that has not finished (no final/ yet); pass {step}, the model of "
        "its newest step checkpoint, or relaunch that run to finish it"
    )
    (out_dir / "final").mkdir()
    assert out_dir_given_as_a_model(out_dir) == (
        f"{out_dir} is a run's out_dir; pass {out_dir / 'final'}, the model it finished with"
    )
    assert out_dir_given_as_a_model(tmp_path / "empty") is None


def test_a_step_checkpoint_given_as_a_model_is_read_only_when_complete_and_of_a_recipe_with_a_model(
    tmp_path: Path,
) -> None:
    step = write_checkpoint(tmp_path / "run" / checkpoint_name(1), {"shards/a": b"12"})
    assert is_step_checkpoint(step) and not is_step_checkpoint(tmp_path / "run")
    state = {
        **read_trainer_state(step),
        "recipe": "pretrain",
        "config": asdict(Config.from_name("tiny-llama")),
    }
    (step / TRAINER_STATE).write_text(json.dumps(state))
    assert step_model_state(step)["recipe"] == "pretrain"
    assert step_model_config(step) == Config.from_name("tiny-llama")
    (step / TRAINER_STATE).write_text(json.dumps({**state, "recipe": "evaluate"}))
    with pytest.raises(
        LitsftError, match="names none of finetune_full, pretrain, finetune_lora with its model"
    ):
        step_model_state(step)
    (step / TRAINER_STATE).write_text(json.dumps({**state, "format": None}))
    with pytest.raises(LitsftError, match="in litsft's earlier row-sharded format"):
        step_model_state(step)
    (step / TRAINER_STATE).write_text(json.dumps(state))
    (step / "shards" / "a").write_bytes(b"1")
    with pytest.raises(
        LitsftError,
        match=r"run/step-00000001 is not a complete step checkpoint \(shards/a is truncated \(1 of 2 bytes\)\), "
        "so it holds no model; pass another step checkpoint of that run, or its final/",
    ):
        step_model_state(step)


def test_the_trainer_state_of_a_complete_checkpoint_only(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / checkpoint_name(5), {"a": b"1"})
    state = read_trainer_state(checkpoint)
    assert state == {
        "step": 1,
        "format": CHECKPOINT_FORMAT,
        "files": ["a"],
        "file_sizes": {"a": 1},
        "file_checksums": {"a": checksum_of_file(checkpoint / "a")},
    }
    (checkpoint / "a").unlink()
    with pytest.raises(LitsftError, match=r"is not a complete litsft training checkpoint .*--resume auto$"):
        read_trainer_state(checkpoint)


FILES = {"rank-00000.pt": b"rng", "rank-00001.pt": b"rng", "shards/rank-00000.safetensors": b"0123456789"}


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda c: (c / "shards" / "rank-00000.safetensors").write_bytes(b"0123"),
         "shards/rank-00000.safetensors is truncated (4 of 10 bytes)"),
        (lambda c: (c / "shards" / "rank-00000.safetensors").write_bytes(b"0123456789ab"),
         "shards/rank-00000.safetensors is longer than written (12 of 10 bytes)"),
        (lambda c: (c / "rank-00001.pt").unlink(), "rank-00001.pt is missing"),
        (lambda c: (c / "shards" / "rank-00002.safetensors").write_bytes(b"x"),
         "shards/rank-00002.safetensors is not a file it was written with"),
        (lambda c: (c / TRAINER_STATE).write_text("{broken"),
         "trainer_state.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        (lambda c: (c / TRAINER_STATE).write_text("[]"), "trainer_state.json has no list of the checkpoint's files"),
        (lambda c: (c / TRAINER_STATE).unlink(), "trainer_state.json is missing"),
    ],
)  # fmt: skip
def test_find_damage_says_how_a_checkpoint_differs_from_what_was_written(
    tmp_path: Path, damage, expected
) -> None:
    checkpoint = write_checkpoint(tmp_path / checkpoint_name(4), FILES)
    assert find_damage(checkpoint) is None
    damage(checkpoint)
    assert find_damage(checkpoint) == expected
    assert not is_complete(checkpoint)


def test_a_file_whose_bytes_changed_at_its_size_is_damage_found_by_its_checksum(tmp_path: Path) -> None:
    """The sizes alone let it through: only reading the contents finds it, and says it is not truncated."""
    checkpoint = write_checkpoint(tmp_path / checkpoint_name(4), FILES)
    assert find_damage(checkpoint, contents=True) is None
    (checkpoint / "shards" / "rank-00000.safetensors").write_bytes(b"0123456788")
    assert find_damage(checkpoint) is None
    assert find_damage(checkpoint, contents=True) == (
        "shards/rank-00000.safetensors does not hold the bytes it was written with (its checksum differs)"
    )


def test_the_checkpoint_a_run_would_resume_is_checked_whole_and_one_whose_bytes_changed_gives_way(
    tmp_path: Path,
) -> None:
    """Steps 2, 4 and 6 with a byte changed in 6 and in 2: 6 is moved aside, 4 (now the newest) is read whole
    and intact, so 2, which no run would resume while 4 is there, is checked by its sizes only and stays."""
    out_dir = tmp_path / "out"
    for step in (2, 4, 6):
        write_checkpoint(out_dir / checkpoint_name(step), FILES)
    for step in (2, 6):
        (out_dir / checkpoint_name(step) / "rank-00001.pt").write_bytes(b"gnr")
    (notice,) = set_aside_damaged_checkpoints(out_dir)
    (aside,) = [p.name for p in out_dir.iterdir() if ".damaged-" in p.name]
    assert notice == (
        f"checkpoint {out_dir / checkpoint_name(6)} is damaged: rank-00001.pt does not hold the bytes it was "
        f"written with (its checksum differs); moved it aside to {aside}"
    )
    assert latest_checkpoint(out_dir) == out_dir / checkpoint_name(4)
    assert (out_dir / checkpoint_name(2)).is_dir()
    # A checkpoint written before checksums were recorded is checked by its sizes, as before.
    state = json.loads((out_dir / checkpoint_name(4) / TRAINER_STATE).read_text())
    del state["file_checksums"]
    (out_dir / checkpoint_name(4) / TRAINER_STATE).write_text(json.dumps(state))
    (out_dir / checkpoint_name(4) / "rank-00001.pt").write_bytes(b"gnr")
    assert set_aside_damaged_checkpoints(out_dir) == []


def test_damaged_checkpoints_are_moved_aside_whole_and_the_newest_intact_one_is_resumed(
    tmp_path: Path,
) -> None:
    out_dir = tmp_path / "out"
    for step in (2, 4, 6):
        write_checkpoint(out_dir / checkpoint_name(step), FILES)
    (out_dir / checkpoint_name(6) / "rank-00001.pt").unlink()
    (out_dir / checkpoint_name(4) / "shards" / "rank-00000.safetensors").write_bytes(b"01")
    notices = set_aside_damaged_checkpoints(out_dir)
    aside = sorted(p.name for p in out_dir.iterdir() if ".damaged-" in p.name)
    assert [name.split(".damaged-")[0] for name in aside] == [checkpoint_name(4), checkpoint_name(6)]
    assert notices == [
        f"checkpoint {out_dir / checkpoint_name(4)} is damaged: shards/rank-00000.safetensors is truncated "
        f"(2 of 10 bytes); moved it aside to {aside[0]}",
        f"checkpoint {out_dir / checkpoint_name(6)} is damaged: rank-00001.pt is missing; moved it aside to {aside[1]}",
    ]
    # Nothing is lost: the damaged directory is there whole, under its new name.
    assert (out_dir / aside[0] / "shards" / "rank-00000.safetensors").read_bytes() == b"01"
    assert sorted(p.name for p in (out_dir / aside[1]).iterdir()) == [
        "rank-00000.pt",
        "shards",
        TRAINER_STATE,
    ]
    assert latest_checkpoint(out_dir) == resume_checkpoint("auto", out_dir) == out_dir / checkpoint_name(2)
    # Step 6 can be saved again under its own name, and damaged twice: each copy keeps its own.
    write_checkpoint(out_dir / checkpoint_name(6), FILES)
    (out_dir / checkpoint_name(6) / "rank-00000.pt").unlink()
    assert len(set_aside_damaged_checkpoints(out_dir)) == 1
    assert len([p for p in out_dir.iterdir() if p.name.startswith(checkpoint_name(6))]) == 2
    assert set_aside_damaged_checkpoints(out_dir) == []


def test_a_checkpoint_in_the_earlier_row_format_is_refused_in_one_line(tmp_path: Path) -> None:
    """Written before DCP: per-rank row blocks, and a trainer_state.json without `format`."""
    files = {"shards/rank-00000.safetensors": b"x", "rank-00000.pt": b"y"}
    old = write_checkpoint(tmp_path / checkpoint_name(3), files)
    state = json.loads((old / TRAINER_STATE).read_text())
    del state["format"]
    (old / TRAINER_STATE).write_text(json.dumps(state))
    assert latest_checkpoint(tmp_path) == old  # complete: refused for its format, not called damaged
    with pytest.raises(
        LitsftError,
        match=r"^\S+step-00000003 is in litsft's earlier row-sharded checkpoint format, which this version no "
        r"longer reads; finish that run with the litsft that wrote it, or start this one in another --out_dir$",
    ):
        read_trainer_state(old)
