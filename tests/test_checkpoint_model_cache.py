"""litsft/checkpoint/model_cache.py: where a folder's model is cached, and the other ranks waiting for the first
to publish it (opening step checkpoints as models: tests/test_checkpoint_step_model.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from launch import write_tiny_checkpoint

from litsft.checkpoint import model_cache
from litsft.checkpoint.model_cache import conversion_cache_dir
from litsft.errors import LitsftError


def test_other_ranks_wait_for_the_first_to_publish_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")  # not the first process: it must not convert, only wait
    target = tmp_path / "converted"
    publish = threading.Timer(1.5, lambda: write_tiny_checkpoint(target))
    publish.start()
    started = time.monotonic()
    model_cache.first_process_makes(target, lambda: pytest.fail("only the first process converts"))
    assert time.monotonic() - started >= 1.0 and (target / "litsft_config.json").is_file()

    monkeypatch.setenv(model_cache.WAIT_ENV, "1")
    with pytest.raises(LitsftError, match="waited 1 s for the first process to write .*never"):
        model_cache.first_process_makes(tmp_path / "never", lambda: None)


def test_the_cache_of_a_step_is_named_after_its_run_and_changes_with_its_files(tmp_path: Path) -> None:
    step = tmp_path / "run" / "step-00000002"
    (step / "shards").mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (step / "shards" / "a.safetensors").write_bytes(b"1")
    files = lambda: sorted(p for p in step.rglob("*") if p.is_file())  # noqa: E731
    first = conversion_cache_dir(step, files())
    assert first.name.startswith("run-step-00000002-") and first.parent.name == "converted"
    (step / "shards" / "a.safetensors").write_bytes(b"22")
    assert conversion_cache_dir(step, files()) != first
