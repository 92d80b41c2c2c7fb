"""The model argument: a litsft checkpoint, a Hugging Face directory (converted once, then reused) or a hub id
(tests/test_huggingface_hub.py), and the ranks that wait while the first process converts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from launch import litsft_in_process, max_difference, write_records, write_tiny_checkpoint
from test_training_engine import finetune_args
from tiny_hf import save_tiny_hf, tiny_hf_model

from litsft.errors import LitsftError
from litsft.huggingface import model_source
from litsft.huggingface.model_source import conversion_cache_dir, hf_conversion_cache_dir, resolve_checkpoint


def test_finetune_full_on_a_hugging_face_folder_converts_it_once(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("LITSFT_CACHE_DIR", str(tmp_path / "cache"))  # where launch.test_env puts the cache
    hf_dir = save_tiny_hf(tiny_hf_model("llama"), tmp_path / "hf" / "tiny")
    write_records(tmp_path / "data.json", count=32)
    first = litsft_in_process(
        finetune_args(hf_dir, tmp_path / "data.json", tmp_path / "run-1", 4, 2), tmp_path, capsys
    )
    cache = hf_conversion_cache_dir(hf_dir)
    assert f"Model: Hugging Face directory {hf_dir}, converted once into {cache}" in first.stdout
    written = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    second = litsft_in_process(
        finetune_args(hf_dir, tmp_path / "data.json", tmp_path / "run-2", 4, 2), tmp_path, capsys
    )
    assert (
        f"Model: Hugging Face directory {hf_dir}, reusing its litsft conversion in {cache}" in second.stdout
    )
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == written  # not converted again
    assert max_difference(tmp_path / "run-1" / "final", tmp_path / "run-2" / "final") == 0
    assert max_difference(cache, tmp_path / "run-1" / "final") > 1e-6  # it trained


def test_a_changed_hugging_face_folder_is_converted_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LITSFT_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = save_tiny_hf(tiny_hf_model("llama"), tmp_path / "hf")
    first = resolve_checkpoint(hf_dir)
    assert resolve_checkpoint(hf_dir) == first
    save_tiny_hf(tiny_hf_model("llama", seed=3), hf_dir)  # new weights in the same place
    second = resolve_checkpoint(hf_dir)
    assert second != first and max_difference(first, second) > 1e-3


def test_a_litsft_checkpoint_is_used_as_is_and_anything_else_is_one_clear_error(
    tmp_path: Path, capsys
) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    assert resolve_checkpoint(checkpoint) == checkpoint
    assert f"Model: litsft checkpoint {checkpoint}" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        LitsftError, match="is neither a litsft checkpoint .* nor a Hugging Face model directory"
    ):
        resolve_checkpoint(tmp_path / "empty")
    with pytest.raises(LitsftError, match="out/run/final does not exist; pass a litsft checkpoint directory"):
        resolve_checkpoint("out/run/final")


def test_other_ranks_wait_for_the_first_to_publish_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")  # not the first process: it must not convert, only wait
    target = tmp_path / "converted"
    publish = threading.Timer(1.5, lambda: write_tiny_checkpoint(target))
    publish.start()
    started = time.monotonic()
    model_source._first_process_makes(target, lambda: pytest.fail("only the first process converts"))
    assert time.monotonic() - started >= 1.0 and (target / "litsft_config.json").is_file()

    monkeypatch.setenv(model_source.WAIT_ENV, "1")
    with pytest.raises(LitsftError, match="waited 1 s for the first process to write .*never"):
        model_source._first_process_makes(tmp_path / "never", lambda: None)


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
