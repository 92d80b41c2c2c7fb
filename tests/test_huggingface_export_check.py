"""litsft/huggingface/export_check.py: an export that transformers answers as litsft does passes, and one that
lost its chat template, its end-of-turn token or its weights is named in one line by what it lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import litsft_in_process, write_records, write_tiny_checkpoint
from safetensors.torch import load_file, save_file

from litsft.checkpoint.checkpoint_dirs import VALIDATION_PROMPTS_FILE
from litsft.huggingface.convert import convert_to_hf
from litsft.huggingface.export_check import check_export, check_prompts


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export_check")
    checkpoint = write_tiny_checkpoint(root / "model", seed=6)
    convert_to_hf(checkpoint, root / "hf", check="off")
    return checkpoint, root / "hf"


def damaged_copy(hf_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "hf"
    copy.mkdir(parents=True)
    for path in hf_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    return copy


def test_a_faithful_export_answers_as_litsft_and_convert_to_hf_says_so(
    exported, tmp_path: Path, capsys
) -> None:
    checkpoint, hf_dir = exported
    assert check_export(checkpoint, hf_dir) is None
    result = litsft_in_process(
        ["convert_to_hf", str(checkpoint), "--out_dir", str(tmp_path / "out")], tmp_path, capsys
    )
    assert "Export check: transformers answers 2 prompts as litsft does, token for token" in result.stdout


def test_a_lost_chat_template_is_named(exported, tmp_path: Path) -> None:
    checkpoint, hf_dir = exported
    copy = damaged_copy(hf_dir, tmp_path)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    assert check_export(checkpoint, copy).startswith("chat template: the export has none")


def test_another_template_is_named_where_it_renders_differently(exported, tmp_path: Path) -> None:
    checkpoint, hf_dir = exported
    copy = damaged_copy(hf_dir, tmp_path)
    template = "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    (copy / "chat_template.jinja").write_text(template)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert check_export(checkpoint, copy).startswith(
        "chat template: the export renders 'Hello! Who are you?' as"
    )


def test_a_lost_end_of_turn_token_is_named(exported, tmp_path: Path) -> None:
    checkpoint, hf_dir = exported
    copy = damaged_copy(hf_dir, tmp_path)
    generation = json.loads((copy / "generation_config.json").read_text())
    generation["eos_token_id"] = 7
    (copy / "generation_config.json").write_text(json.dumps(generation))
    assert check_export(checkpoint, copy).startswith("end of turn: litsft stops generating at token ids")


def test_other_weights_are_named(exported, tmp_path: Path) -> None:
    checkpoint, hf_dir = exported
    copy = damaged_copy(hf_dir, tmp_path)
    weights = load_file(copy / "model.safetensors")
    weights["model.norm.weight"] = -weights["model.norm.weight"]
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert check_export(checkpoint, copy).startswith(
        "weights: for 'Hello! Who are you?' the export generates"
    )


def test_a_difference_is_a_warning_by_default_and_an_error_with_check_on(
    exported, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export is written either way; `--check on` makes a difference exit 2 with one line."""
    checkpoint, _ = exported
    monkeypatch.setattr("litsft.huggingface.convert.check_export", lambda *args: "weights: something")
    command = ["convert_to_hf", str(checkpoint), "--out_dir"]
    warned = litsft_in_process([*command, str(tmp_path / "auto")], tmp_path, capsys)
    assert "Warning: the export differs from the litsft model in its weights: something" in warned.stderr
    refused = litsft_in_process(
        [*command, str(tmp_path / "on"), "--check", "on"], tmp_path, capsys, check=False
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "error: the export differs from the litsft model in its weights: something" in refused.stderr
    assert (tmp_path / "auto" / "model.safetensors").is_file() and (
        tmp_path / "on" / "model.safetensors"
    ).is_file()


def test_a_runs_final_model_keeps_its_validation_prompts_and_the_check_asks_them(
    tmp_path: Path, capsys
) -> None:
    base = write_tiny_checkpoint(tmp_path / "base", seed=6)
    data = write_records(tmp_path / "data.json", count=16)
    out_dir = tmp_path / "run"
    args = [
        "finetune_full",
        str(base),
        "--data",
        "JSON",
        "--data.json_path",
        str(data),
        "--out_dir",
        str(out_dir),
    ]
    args += ["--data.val_split_fraction", "0.25", "--train.max_steps", "1", "--train.global_batch_size", "2"]
    args += ["--train.micro_batch_size", "2"]
    args += ["--train.max_seq_length", "64", "--eval.max_new_tokens", "0", "--accelerator", "cpu"]
    litsft_in_process(args, tmp_path, capsys)
    kept = json.loads((out_dir / "final" / VALIDATION_PROMPTS_FILE).read_text())
    records = json.loads(data.read_text())
    assert len(kept) == 2 and all(conversation[-1]["role"] == "user" for conversation in kept)
    assert all(any(c[-1]["content"] in json.dumps(r) for r in records) for c in kept)  # the run's own prompts
    assert check_prompts(out_dir / "final") == kept

    result = litsft_in_process(
        ["convert_to_hf", str(out_dir / "final"), "--out_dir", str(tmp_path / "hf")], tmp_path, capsys
    )
    assert "transformers answers 2 of the run's validation prompts as litsft does" in result.stdout
    # A difference is named by the kept prompt it shows in.
    copy = damaged_copy(tmp_path / "hf", tmp_path / "damaged")
    (copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    label = kept[0][-1]["content"][:20]
    assert label in check_export(out_dir / "final", copy)
