"""litsft/data/prepare.py (`litsft prepare`): which files become the training and the validation split, what
is refused before anything is tokenized, and the line it ends with. The tokenizing itself is stood in for
here (tests/test_data_litdata_shards.py tests it); a real `prepare` read back by `--data LitData` is in
tests/test_data_text.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_tokenizer import write_tiny_tokenizer

import litsft.data.prepare as prepare_module
from litsft.data.prepare import prepare
from litsft.errors import LitsftError


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The split each optimize_text call would write, by its directory name, with the names of its files."""
    splits: dict[str, list[str]] = {}

    def record(files, out_dir, checkpoint_dir, num_workers, chunk_bytes) -> None:
        splits[Path(out_dir).name] = [Path(f).name for f in files]

    monkeypatch.setattr(prepare_module, "optimize_text", record)
    return splits


def corpus(directory: Path, count: int) -> Path:
    directory.mkdir(parents=True)
    for i in range(count):
        (directory / f"{i:02d}.txt").write_text(f"text {i}\n")
    (directory / "notes.md").write_text("not a text file\n")
    return directory


@pytest.mark.parametrize(
    ("count", "val_fraction", "val_files"),
    [(10, 0.2, ["08.txt", "09.txt"]), (10, 0.01, ["09.txt"]), (10, 0.0, []), (1, 0.5, [])],
)
def test_the_last_files_of_the_sorted_list_are_held_out(
    tmp_path, tokenizer_dir, written, capsys, count, val_fraction, val_files
) -> None:
    prepare(corpus(tmp_path / "corpus", count), tmp_path / "out", tokenizer_dir, val_fraction=val_fraction)
    train = [f"{i:02d}.txt" for i in range(count) if f"{i:02d}.txt" not in val_files]
    assert written == ({"train": train, "val": val_files} if val_files else {"train": train})
    assert capsys.readouterr().out == (
        f"wrote {tmp_path / 'out'}: {len(train)} training and {len(val_files)} validation files\n"
    )


@pytest.mark.parametrize("val_fraction", [1.0, -0.1])
def test_a_validation_share_outside_0_to_1_is_refused(tmp_path, tokenizer_dir, written, val_fraction) -> None:
    with pytest.raises(LitsftError) as error:
        prepare(corpus(tmp_path / "corpus", 3), tmp_path / "out", tokenizer_dir, val_fraction=val_fraction)
    assert str(error.value) == f"val_fraction={val_fraction} must be in [0, 1)"
    assert written == {} and not (tmp_path / "out").exists()


def test_a_non_empty_out_dir_is_refused_and_an_empty_one_used(tmp_path, tokenizer_dir, written) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(LitsftError) as error:
        prepare(corpus(tmp_path / "corpus", 3), tmp_path / "out", tokenizer_dir)
    assert (
        str(error.value) == f"{tmp_path / 'out'} exists and is not empty; choose a new --out_dir or delete it"
    )
    assert written == {} and (tmp_path / "out" / "mine.txt").read_text() == "keep"
    (tmp_path / "out" / "mine.txt").unlink()
    prepare(tmp_path / "corpus", tmp_path / "out", tokenizer_dir)
    assert written == {"train": ["00.txt", "01.txt"], "val": ["02.txt"]}


def test_bad_text_is_refused_before_anything_is_tokenized(tmp_path, tokenizer_dir, written) -> None:
    directory = corpus(tmp_path / "corpus", 3)
    (directory / "01.txt").write_bytes(b"fine\n\xff\n")
    with pytest.raises(LitsftError, match=r"01.txt line 2: byte 0xff is not valid UTF-8"):
        prepare(directory, tmp_path / "out", tokenizer_dir)
    (tmp_path / "no-text").mkdir()
    with pytest.raises(LitsftError, match=r"holds no .txt files"):
        prepare(tmp_path / "no-text", tmp_path / "out", tokenizer_dir)
    assert written == {} and not (tmp_path / "out").exists()


def test_text_files_are_found_in_subdirectories_and_one_file_is_all_training(
    tmp_path, tokenizer_dir, written
) -> None:
    (tmp_path / "corpus" / "deep" / "er").mkdir(parents=True)
    (tmp_path / "corpus" / "deep" / "er" / "a.txt").write_text("a\n")
    prepare(tmp_path / "corpus", tmp_path / "out", tokenizer_dir, val_fraction=0.5)
    assert written == {"train": ["a.txt"]}
