"""The model argument: a litsft checkpoint, a Hugging Face directory (converted once, then reused) or a hub id
(tests/test_huggingface_hub.py), and the ranks that wait while the first process converts."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import litsft_in_process, max_difference, write_records, write_tiny_checkpoint
from test_training_engine import finetune_args
from tiny_hf import save_tiny_hf, tiny_hf_model

from litsft.errors import LitsftError
from litsft.huggingface.model_source import hf_conversion_cache_dir, resolve_checkpoint


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
