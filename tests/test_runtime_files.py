import os

import pytest

from litsft.errors import LitsftError
from litsft.runtime.files import publish_atomically


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
