"""The LoRA recipe end to end: the same engine as full fine-tuning with a different model and a different save."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from launch import TINY_PHI3, litsft, write_records, write_tiny_checkpoint
from safetensors.torch import load_file
from test_engine import finetune_args

from litsft.generate import load_model
from litsft.lora import iter_merged_tensors
from litsft.model import Transformer
from litsft.storage.lora_folder import read_lora_folder


def lora_args(
    checkpoint: Path, data: Path, out_dir: Path, micro: int, steps: int, *extra: str, dropout: float = 0.1
) -> list[str]:
    args = finetune_args(checkpoint, data, out_dir, micro, steps, *extra)
    return [
        "finetune_lora",
        *args[1:],
        "--lora.rank",
        "4",
        "--lora.alpha",
        "8",
        "--lora.dropout",
        str(dropout),
    ]


def digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    write_tiny_checkpoint(root / "base", seed=1)
    write_tiny_checkpoint(root / "base-tiny-gemma2", seed=1, model="tiny-gemma2")
    write_tiny_checkpoint(root / "base-tiny-phi3", seed=1, **TINY_PHI3)
    write_records(root / "data.json", count=48)
    return root


def test_resume_gives_identical_adapters_and_the_base_never_changes(workspace: Path) -> None:
    base, data = workspace / "base", workspace / "data.json"
    base_before = digest(base)
    args = ["--devices", "2", "--fsdp.sharding_strategy", "FULL_SHARD", "--train.save_interval", "6"]
    uninterrupted, resumed = workspace / "uninterrupted", workspace / "resumed"
    result = litsft(lora_args(base, data, uninterrupted, 2, 12, *args), workspace)
    assert (
        "Trainable parameters:" in result.stdout and "vs" in result.stdout
    )  # adapter vs full memory, in the log
    shutil.copytree(uninterrupted, resumed)
    shutil.rmtree(resumed / "step-00000012")
    shutil.rmtree(resumed / "final")
    result = litsft(lora_args(base, data, resumed, 2, 12, *args), workspace)
    assert "Resumed from" in result.stdout + result.stderr

    a = load_file(uninterrupted / "final" / "adapter.safetensors")
    b = load_file(resumed / "final" / "adapter.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a), "adapters were trained"
    assert digest(base) == base_before  # frozen base: not a byte of it changed

    # Step checkpoints hold adapters and their optimizer state only, not the frozen base.
    shard = load_file(uninterrupted / "step-00000006" / "shards" / "rank-00000.safetensors")
    assert shard and all(".lora_" in key for key in shard)


@pytest.mark.parametrize("named", ["tiny-llama", "tiny-gemma2", "tiny-phi3"])
def test_lora_on_two_processes_equals_one_and_exports_to_transformers(workspace: Path, named: str) -> None:
    base, data = workspace / ("base" if named == "tiny-llama" else f"base-{named}"), workspace / "data.json"
    single, double = workspace / named / "single", workspace / named / "double"
    # No dropout here: its masks depend on how rows are split over ranks.
    litsft(lora_args(base, data, single, 4, 4, dropout=0.0), workspace)
    litsft(lora_args(base, data, double, 2, 4, "--devices", "2", dropout=0.0), workspace)
    a = load_file(single / "final" / "adapter.safetensors")
    b = load_file(double / "final" / "adapter.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

    # Merged model = base + adapters; exported to HF it gives the same logits in transformers.
    folder = read_lora_folder(single / "final")
    model = load_model(folder.base_dir, torch.device("cpu"), torch.float32)
    base = model.state_dict()
    model.load_state_dict(dict(iter_merged_tensors(base.items(), folder.adapters, folder.config)))
    litsft(["convert_to_hf", str(single / "final"), "--out_dir", str(workspace / named / "hf")], workspace)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(workspace / named / "hf").eval()
    tokens = torch.randint(0, 500, (2, 64))  # past the tiny Phi-3's LongRoPE switch
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() < 1e-4
    assert isinstance(model, Transformer)
