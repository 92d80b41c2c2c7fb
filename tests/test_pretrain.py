"""The pretraining recipe: fresh weights that do not depend on the number of ranks, streamed text, learning."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from launch import litsft, litsft_in_process, max_difference
from tiny_tokenizer import write_tiny_tokenizer

from litsft.data import write_demo_corpus


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrain")
    write_tiny_tokenizer(root / "tokenizer")
    write_demo_corpus(root / "corpus", num_examples=2000, num_files=8)
    return root


def pretrain_args(root: Path, out: str, steps: int, lr: float, *extra: str) -> list[str]:
    return [
        "pretrain", "tiny-llama", "--tokenizer_dir", str(root / "tokenizer"), "--out_dir", str(root / out),
        "--data", "TextFiles", "--data.train_data_path", str(root / "corpus"), "--train.max_steps", str(steps),
        "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "64",
        "--optimizer.lr", str(lr), "--optimizer.min_lr", "0", "--optimizer.warmup_steps", "0", "--precision", "32-true",
        "--accelerator", "cpu", *extra,
    ]  # fmt: skip


def test_fresh_weights_do_not_depend_on_the_number_of_ranks(workspace: Path, capsys) -> None:
    # lr 0 is refused, so the step is made too small to move any weight: an AdamW update is at most about
    # lr in size, and 1e-30 is far below half the spacing of fp32 numbers near any initial weight.
    litsft_in_process(pretrain_args(workspace, "init-1", 1, 1e-30), workspace, capsys)  # one rank: in-process
    litsft(pretrain_args(workspace, "init-2", 1, 1e-30, "--devices", "2"), workspace)
    assert max_difference(workspace / "init-1" / "final", workspace / "init-2" / "final") == 0.0


def test_pretraining_on_text_files_lowers_the_loss(workspace: Path) -> None:
    litsft(
        pretrain_args(workspace, "run", 40, 3e-3, "--devices", "2", "--train.log_interval", "5"), workspace
    )
    losses = [
        float(r["loss"]) for r in csv.DictReader((workspace / "run" / "metrics.csv").open()) if r["loss"]
    ]
    assert losses[-1] < 0.7 * losses[0], losses
