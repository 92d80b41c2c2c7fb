import os

import pytest

from litsft.errors import LitsftError
from litsft.storage.files import publish_atomically


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
