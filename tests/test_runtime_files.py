import json
import os

import pytest

from litsft.errors import LitsftError
from litsft.runtime import files
from litsft.runtime.files import (
    checksum_of_file,
    json_problem,
    publish_atomically,
    readable_size,
    write_bytes,
)


def test_publish_atomically_leaves_nothing_on_failure(tmp_path):
    out_dir = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), publish_atomically(out_dir, "the output") as work_dir:
        (work_dir / "model.safetensors").write_text("partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_publish_atomically_renames_on_success_and_refuses_non_empty(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()  # an empty directory is fine
    with publish_atomically(out_dir, "the output") as work_dir:
        (work_dir / "a.txt").write_text("a")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out_dir / "a.txt").read_text() == "a"
    umask = os.umask(0)
    os.umask(umask)
    assert out_dir.stat().st_mode & 0o777 == 0o777 & ~umask  # not tempfile's private 0700
    with pytest.raises(LitsftError) as err, publish_atomically(out_dir, "the output"):
        pass
    assert str(err.value) == (
        f"output directory {out_dir} already exists and is not empty; choose another --out_dir or remove it"
    )
    assert [p.name for p in out_dir.iterdir()] == ["a.txt"]


def test_publish_atomically_turns_write_failures_into_one_line(tmp_path):
    out_dir = tmp_path / "out"
    with (
        pytest.raises(LitsftError) as err,
        publish_atomically(out_dir, "the thing", fix="try elsewhere") as work,
    ):
        (work / "a.txt").write_text("a")
        raise OSError(28, "No space left on device", str(work / "b.txt"))
    assert str(err.value) == (
        f"cannot write the thing to {out_dir} (No space left on device: {work / 'b.txt'}); try elsewhere"
    )
    assert list(tmp_path.iterdir()) == []


def test_publish_atomically_reuses_a_fixed_staging_name(tmp_path):
    """Several processes agree on the staging name; a crash's leftover under it is cleared first."""
    staging = tmp_path / ".out.partial"
    staging.mkdir()
    (staging / "stale.txt").write_text("left by a crash")
    with publish_atomically(tmp_path / "out", "the thing", staging=staging) as work:
        assert work == staging and list(work.iterdir()) == []
        (work / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]


def test_a_file_written_is_hashed_as_written_and_equals_hashing_it_on_disk(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    written = write_bytes(path, b"x" * 100_000, durable=True)
    assert written == checksum_of_file(path, chunk_bytes=4096) and written.startswith("xxh3_128:")
    path.write_bytes(b"x" * 99_999 + b"y")  # the same size, one byte changed
    assert checksum_of_file(path) != written

    class FullDisk:
        def __init__(self, file) -> None:
            self.file = file

        def write(self, data) -> int:
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str):
            return getattr(self.file, name)

    real_open = open
    monkeypatch.setattr(files, "open", lambda *a, **k: FullDisk(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError) as refused:
        write_bytes(tmp_path / "g.bin", b"data")
    assert str(refused.value) == f"[Errno 28] No space left on device: '{tmp_path / 'g.bin'}'"


def test_sizes_read_in_three_significant_digits():
    sizes = [0, 999, 1000, 1_234_567, 5.5e9, 2e15]
    assert [readable_size(n) for n in sizes] == ["0 B", "999 B", "1 kB", "1.23 MB", "5.5 GB", "2,000 TB"]


def test_json_problem_says_at_column_once() -> None:
    """json's own messages end with "at" for some errors ("Unterminated string starting at"): once "at" only."""
    with pytest.raises(json.JSONDecodeError) as unterminated:
        json.loads('{"city": "Par')
    assert json_problem(unterminated.value) == "Unterminated string starting at column 10"
    with pytest.raises(json.JSONDecodeError) as missing:
        json.loads('{"city": }')
    assert json_problem(missing.value) == "Expecting value at column 10"
    assert json_problem(missing.value, column=3) == "Expecting value at column 3"
