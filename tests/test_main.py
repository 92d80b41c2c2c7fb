"""The `litsft` command itself (litsft/__main__.py): --help shows what each option does, --version, and what
they and a refused command line import (neither torch nor Lightning)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import DEADLINE_S, litsft, write_records, write_tiny_checkpoint

from litsft.__main__ import COMMANDS, _load, main

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
    assert re.search(
        r"--data.record_shape \{auto,messages,sharegpt,alpaca,prompt_completion,preference,text\}", hf_data
    )


def test_version(capsys: pytest.CaptureFixture) -> None:
    main(["--version"])
    # tomllib is Python 3.11+, and the package supports 3.10.
    expected = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert capsys.readouterr().out == f"litsft {expected}\n"


# ---- start-up: what a command imports before it answers -------------------------------------------------
def imported_modules(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`litsft <args>` run under `python -X importtime` (PYTHONPROFILEIMPORTTIME), and every module it imported."""
    result = litsft(args, tmp_path, check=False, cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    modules = {
        line.rpartition("|")[2].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "litsft" in modules, result.stderr[-2000:]  # the list is there to read
    return result, modules


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in ("torch", "lightning"))


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["finetune_full", "--help"],
        ["finetune_lora", "--data.help", "JSON"],
        [
            "pretrain",
            "--data",
            "TextFiles",
            "--data.train_data_path",
            "corpus",
            "--print_config",
            "demo-llama",
        ],
    ],
    ids=["help", "version", "recipe-help", "data-help", "print_config"],
)
def test_help_version_and_print_config_import_neither_torch_nor_lightning(
    args: list[str], tmp_path: Path
) -> None:
    result, modules = imported_modules(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert heavy(modules) == []
    assert result.stdout.strip()


def test_a_refused_run_is_refused_before_torch_and_lightning_are_imported(tmp_path: Path) -> None:
    result, modules = imported_modules(["finetune_full", "no/such/checkpoint", "--data", "Demo"], tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines()[-1].startswith(
        "error: no/such/checkpoint does not exist"
    )
    assert heavy(modules) == []
    # Refused by the checks before launch: the model and the data are read, out_dir is found finished.
    base = write_tiny_checkpoint(tmp_path / "base")
    (tmp_path / "out" / "final").mkdir(parents=True)
    args = [
        "finetune_full",
        str(base),
        "--data",
        "JSON",
        "--data.json_path",
        str(write_records(tmp_path / "data.json")),
    ]
    result, modules = imported_modules([*args, "--out_dir", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 2 and "this run has finished" in result.stderr.splitlines()[-1]
    assert heavy(modules) == []


def test_usage_lists_every_command_with_the_first_line_of_its_docstring(
    capsys: pytest.CaptureFixture,
) -> None:
    main(["--help"])
    usage = capsys.readouterr().out
    for name, target in COMMANDS.items():
        module_name, function_name = target.split(":")
        doc = getattr(importlib.import_module(module_name), function_name).__doc__.strip().splitlines()[0]
        assert f"  {name:<16} {doc}\n" in usage


@pytest.mark.parametrize("command", ["finetune_full", "finetune_lora", "pretrain"])
def test_every_option_of_a_training_command_says_what_it_does(command: str) -> None:
    from functools import partial

    from jsonargparse import CLI, capture_parser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # as main() does
    parser = capture_parser(partial(CLI, _load(COMMANDS[command]), args=[], as_positional=True))
    undocumented = [a.dest for a in parser._actions if not a.help or a.help.startswith("(type")]
    assert undocumented == []


def test_data_help_without_a_class_lists_the_data_modules(capsys: pytest.CaptureFixture) -> None:
    main(["finetune_full", "--data.help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("--data takes one of these (--data.help NAME lists its options):")
    for name, summary in [("JSON", "Records from a .json / .jsonl file"), ("Demo", "Synthetic instructions"),
                          ("TextFiles", "Plain .txt files"), ("LitData", "A token dataset optimized")]:  # fmt: skip
        assert f" {name} {summary}" in text


def test_help_and_tutorial_say_what_resume_false_does_with_checkpoints(capsys: pytest.CaptureFixture) -> None:
    """It is refused (tests/test_bad_inputs.py), so that no checkpoint is overwritten; both say so."""
    said = "refused when out_dir holds checkpoints (so that none is overwritten): pass another --out_dir"
    for command in ("finetune_full", "finetune_lora", "pretrain"):
        assert said in help_text([command, "--help"], capsys)
    assert said in " ".join((REPO / "tutorials" / "resume.md").read_text().replace("`", "").split())


def test_leave_runs_what_python_would_at_exit_and_exits_zero(tmp_path):
    """`leave` skips Python's module teardown only: a non-daemon thread still finishes, atexit handlers run,
    and unflushed output reaches the streams."""
    script = f"""
import atexit, threading, time
from pathlib import Path
from litsft.__main__ import leave

def late_write():
    time.sleep(0.2)
    Path({str(tmp_path / "thread.txt")!r}).write_text("done")

threading.Thread(target=late_write).start()
atexit.register(lambda: print("atexit ran", end=""))
print("unflushed ", end="")
leave()
print("never")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "unflushed atexit ran"
    assert (tmp_path / "thread.txt").read_text() == "done"


@pytest.mark.parametrize(("code", "left"), [(124, True), (0, True), (2, False)])
def test_a_stopped_run_leaves_through_leave_with_its_status_and_an_error_does_not(tmp_path, code, left):
    """A run stopped by a signal ends as a finished one does (124, or 0 on a rank the launcher reports for):
    atexit handlers run and Python's teardown is skipped, so no C++ thread can end it in std::terminate
    then. A usage error (2) exits through Python's shutdown as before."""
    script = f"""
import atexit, sys
import litsft.__main__ as entry

def stopped():
    raise SystemExit({code})

class TornDown:
    def __del__(self):
        sys.stdout.write(" torn down")
        sys.stdout.flush()

kept = TornDown()  # a module global: deleted by Python's teardown only
entry.main = stopped
atexit.register(lambda: print("atexit ran", end=""))
entry.run()
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert result.returncode == code, result.stderr
    assert result.stdout == ("atexit ran" if left else "atexit ran torn down"), result.stdout


def test_the_console_script_leaves_through_leave():
    """The installed `litsft` command is `run` (main, then leave), and `python -m litsft` is the same."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "litsft"]
    assert script.value == "litsft.__main__:run"
    source = Path(main.__code__.co_filename).read_text()
    assert source.rstrip().endswith('if __name__ == "__main__":\n    run()')
