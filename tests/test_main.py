"""The `litsft` command itself (litsft/__main__.py): --help shows what each option does, --version."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from litsft.__main__ import main

REPO = Path(__file__).resolve().parents[1]


def help_text(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None)
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def test_help_shows_the_attribute_docstrings_of_every_option_group(capsys: pytest.CaptureFixture) -> None:
    text = help_text(["finetune_lora", "--help"], capsys)
    for option, doc in [
        ("--train.global_batch_size", "Rows (packed sequences or samples) per optimizer step"),
        ("--eval.interval", "Validate every this many optimizer steps (and always at the end)."),
        ("--optimizer.lr", "Peak learning rate, reached at the end of warmup."),
        ("--optimizer.warmup_fraction", "Warmup as a fraction of all optimizer steps"),
        ("--lora.alpha", "The adapter's output is scaled by alpha / rank."),
        ("--fsdp.activation_checkpointing", "Recompute each block's activations in the backward pass"),
    ]:
        assert re.search(rf"{re.escape(option)} \S+ {re.escape(doc)}", text), option
    data = help_text(["finetune_lora", "--data.help", "JSON"], capsys)
    assert "--data.mask_prompt {true,false} Only the assistant's tokens carry loss" in data
    assert "--data.json_path JSON_PATH A .json or .jsonl file" in data
    hf_data = help_text(["finetune_full", "--data.help", "HFDataset"], capsys)
    assert "--data.path PATH A hub dataset id (e.g. BAAI/Infinity-Instruct)" in hf_data
    assert re.search(r"--data.record_shape \{auto,messages,sharegpt,alpaca,prompt_completion,text\}", hf_data)


def test_version(capsys: pytest.CaptureFixture) -> None:
    main(["--version"])
    # tomllib is Python 3.11+, and the package supports 3.10.
    expected = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert capsys.readouterr().out == f"litsft {expected}\n"
