"""The pretraining recipe: fresh weights that do not depend on the number of ranks, streamed text, learning."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from launch import TINY_MOE, litsft, litsft_in_process, max_difference, stopped_copy
from tiny_tokenizer import write_tiny_tokenizer

from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.data import write_demo_corpus
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer


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


INIT_STD = 0.02
"""`Transformer.initial_value`'s default: normal(0, 0.02), the residual-stream projections divided by sqrt(2 L)."""


def assert_drawn_from_the_init(final_dir: Path) -> None:
    """Each weight matrix looks drawn from the documented init: its mean within 5 standard errors of 0 and its
    standard deviation within 5 standard errors of the expected one (a sample std's relative standard error is
    1/sqrt(2 n): 1.6% for tiny-llama's smallest matrices, 2,048 entries, whose draws measured at most 4.6% off);
    norm scales exactly 1, biases exactly 0. An all-zero init, or a std off by a factor of 2, fails."""
    config = Config.from_checkpoint(final_dir)
    for name, weight in load_model_state_dict(final_dir).items():
        weight = weight.double()
        if name.endswith("norm.weight"):
            assert torch.equal(weight, torch.ones_like(weight)), name
            continue
        if name.endswith(".bias"):
            assert not weight.any(), name
            continue
        std = (
            INIT_STD / math.sqrt(2 * config.num_layers)
            if name.endswith(("o_proj.weight", "down_proj.weight"))
            else INIT_STD
        )
        assert abs(weight.mean().item()) < 5 * std / math.sqrt(weight.numel()), (name, weight.mean().item())
        relative_error = 1 / math.sqrt(2 * weight.numel())
        assert abs(weight.std().item() / std - 1) < 5 * relative_error, (name, weight.std().item(), std)


def test_fresh_weights_do_not_depend_on_the_number_of_ranks(workspace: Path, capsys) -> None:
    """One rank and two draw the same weights, and they are the init's draws (an all-zero init, below, is the
    same on any number of ranks too, and fails)."""
    # lr 0 is refused, so the step is made too small to move any weight: an AdamW update is at most about
    # lr in size, and 1e-30 is far below half the spacing of fp32 numbers near any initial weight.
    litsft_in_process(pretrain_args(workspace, "init-1", 1, 1e-30), workspace, capsys)  # one rank: in-process
    litsft(pretrain_args(workspace, "init-2", 1, 1e-30, "--devices", "2"), workspace)
    assert max_difference(workspace / "init-1" / "final", workspace / "init-2" / "final") == 0.0
    assert_drawn_from_the_init(workspace / "init-2" / "final")


def test_the_init_check_fails_an_all_zero_init(workspace: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(Transformer, "initial_value", lambda self, name, shape, generator: torch.zeros(shape))
    litsft_in_process(pretrain_args(workspace, "init-zero", 1, 1e-30), workspace, capsys)
    assert not any(w.any() for w in load_model_state_dict(workspace / "init-zero" / "final").values())
    with pytest.raises(AssertionError, match=r"weight', 0\.0, 0\.02"):
        assert_drawn_from_the_init(workspace / "init-zero" / "final")


def test_a_mixture_of_experts_pretrained_with_its_own_load_balancing_weight_resumes(
    workspace: Path, capsys
) -> None:
    """pretrain --train.router_aux_loss_coef, stopped after step 2 of 4 and relaunched with the same command:
    it resumes (it was refused as "written for a different model") to the uninterrupted run's weights."""
    model = workspace / "tiny-moe"
    model.mkdir()
    Config.from_name("tiny-llama", **TINY_MOE).save(model)

    def args(out: str) -> list[str]:
        command = pretrain_args(workspace, out, 4, 1e-3, "--train.save_interval", "2")
        return [command[0], str(model), *command[2:], "--train.router_aux_loss_coef", "0.1"]

    litsft_in_process(args("moe-coef-uninterrupted"), workspace, capsys)
    stopped_copy(workspace / "moe-coef-uninterrupted", workspace / "moe-coef-resumed", last_step=4)
    result = litsft_in_process(args("moe-coef-resumed"), workspace, capsys)
    assert "Resumed from" in result.stdout + result.stderr
    assert (
        max_difference(
            workspace / "moe-coef-uninterrupted" / "final", workspace / "moe-coef-resumed" / "final"
        )
        == 0.0
    )


def test_a_mixture_of_experts_pretrained_with_balancing_biases_resumes_exactly_on_two_processes(
    workspace: Path,
) -> None:
    """pretrain --train.router_bias_update_rate on 2 processes, stopped after step 2 of 4 and relaunched: the
    routers' biases, moved after every step by the load summed over both ranks, are saved in the step
    checkpoints and final/, and the resumed run ends on the uninterrupted run's weights and biases; the export
    to Hugging Face, whose Qwen3-MoE has no such bias, is refused in one line."""
    from litsft.huggingface.convert import convert_to_hf

    model = workspace / "tiny-moe"
    model.mkdir(exist_ok=True)
    Config.from_name("tiny-llama", **TINY_MOE).save(model)

    def args(out: str) -> list[str]:
        command = pretrain_args(workspace, out, 4, 1e-3, "--train.save_interval", "2", "--devices", "2")
        return [command[0], str(model), *command[2:], "--train.router_bias_update_rate", "0.01"]

    litsft(args("moe-bias-uninterrupted"), workspace)
    stopped_copy(workspace / "moe-bias-uninterrupted", workspace / "moe-bias-resumed", last_step=4)
    result = litsft(args("moe-bias-resumed"), workspace)
    assert "Resumed from" in result.stdout + result.stderr
    final = workspace / "moe-bias-uninterrupted" / "final"
    assert max_difference(final, workspace / "moe-bias-resumed" / "final") == 0.0
    biases = {name: t for name, t in load_model_state_dict(final).items() if name.endswith("balancing_bias")}
    assert len(biases) == 2 and all(bias.abs().max() > 0 for bias in biases.values())
    # Each step moves every expert by 0.01 one way or the other (or not at all, at exactly the mean load).
    assert all(((bias / 0.01).round() - bias / 0.01).abs().max() < 1e-3 for bias in biases.values())
    with pytest.raises(
        LitsftError, match="trained with --train.router_bias_update_rate: .* has no such bias"
    ):
        convert_to_hf(final, workspace / "moe-bias-hf")


def test_pretraining_on_text_files_lowers_the_loss(workspace: Path) -> None:
    litsft(
        pretrain_args(workspace, "run", 40, 3e-3, "--devices", "2", "--train.log_interval", "5"), workspace
    )
    losses = [
        float(r["loss"]) for r in csv.DictReader((workspace / "run" / "metrics.csv").open()) if r["loss"]
    ]
    assert losses[-1] < 0.7 * losses[0], losses
