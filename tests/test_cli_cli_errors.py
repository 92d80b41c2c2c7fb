"""litsft/cli/cli_errors.py against the finetune_full parser, in this process: the one line for an unknown option
or config key (close spellings, another tool's name, the option in another group, the chosen data module's
fields), for a --config that is not YAML, and `--data.help` without a class. The same lines end to end, from
the `litsft` command, are in tests/test_bad_inputs.py."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import get_args

import pytest
from jsonargparse import CLI, capture_parser
from litsft.recipes import finetune_full
from tiny_datasets import registered_data_modules

from litsft.cli.cli_errors import (
    argument_error_line,
    bare_subclass_help,
    explain_parse_error,
    list_subclasses,
)
from litsft.data.chat import PromptStyle
from litsft.data.records import RecordShape
from litsft.training.args import Precision


def make_parser():
    """The parser `litsft finetune_full` parses with."""
    return capture_parser(partial(CLI, finetune_full.setup, as_positional=True, exit_on_error=False, args=[]))


def choices(literal: object) -> str:
    """The values of a Literal as the parse error lists them: 'a', 'b', ..."""
    return ", ".join(repr(value) for value in get_args(literal))


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--train.max_step", "3"], "unknown option --train.max_step; did you mean --train.max_steps?"),
        (["--train.max_steps=3", "--train.epoch=2"], "unknown option --train.epoch; did you mean --train.epochs?"),
        (["--per_device_train_batch_size", "4"], "unknown option --per_device_train_batch_size; did you mean --train.micro_batch_size?"),
        (["--warmup_ratio", "0.1"], "unknown option --warmup_ratio; did you mean --optimizer.warmup_fraction?"),
        (["--zzz", "1"], "unknown option --zzz; --help lists every option"),
        (["--data", "JSON", "--data.mask_promt", "false"], "unknown option --data.mask_promt of --data JSON; did you mean --data.mask_prompt?"),
        (["--data", "litsft.data.JSON", "--data.zzz", "1"], "unknown option --data.zzz of --data JSON; --data.help JSON lists its options"),
        (["--data.zzz", "1"], "unknown option --data.zzz; --data.help <class> lists its options"),
        (["--quantize", "nf4"], "unknown option --quantize; QLoRA (an NF4 base with adapters trained over it) is `litsft finetune_lora --quantize nf4`; finetune_full and pretrain train every weight, which cannot stay 4-bit"),
        (["--lora.rank", "8"], "unknown option --lora.rank; LoRA adapters are trained by `litsft finetune_lora` (with --lora.*)"),
    ],
)  # fmt: skip
def test_an_unknown_option_is_named_with_what_was_meant(argv: list[str], line: str) -> None:
    assert explain_parse_error(make_parser, ["checkpoints/x", *argv]) == line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--lora.r", "8"], "unknown option --lora.r; did you mean --lora.rank?"),
        (["--lora.lora_alpha", "16"], "unknown option --lora.lora_alpha; did you mean --lora.alpha?"),
        (["--lora.target_modules", "q_proj"], "unknown option --lora.target_modules; did you mean --lora.targets?"),
        (["--lora_dropout", "0.1"], "unknown option --lora_dropout; did you mean --lora.dropout?"),
        (["--lora.zzz", "1"], "unknown option --lora.zzz; --help lists every option"),
    ],
)  # fmt: skip
def test_finetune_lora_names_its_own_lora_options_never_itself(argv: list[str], line: str) -> None:
    """PEFT's LoraConfig names lead to litsft's; an unknown --lora.* is not sent to `litsft finetune_lora`,
    the command it was given to."""
    from litsft.recipes import finetune_lora

    def make_lora_parser():
        return capture_parser(
            partial(CLI, finetune_lora.setup, as_positional=True, exit_on_error=False, args=[])
        )

    assert explain_parse_error(make_lora_parser, ["checkpoints/x", *argv]) == line


# ---- a bad value in one line -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("message", "line"),
    [
        (
            "Parser key \"fsdp.sharding_strategy\":\n  Expected a typing.Literal['FULL_SHARD', 'NO_SHARD']. "
            "Got value: FOO",
            "--fsdp.sharding_strategy=FOO is not one of 'FULL_SHARD', 'NO_SHARD'",
        ),
        (
            'Parser key "precision":\n  Does not validate against any of the Union subtypes\n  Subtypes: '
            "[typing.Literal['bf16-mixed', '32-true'], <class 'NoneType'>]\n  Errors:\n    - Expected a "
            "typing.Literal['bf16-mixed', '32-true']\n    - Expected a <class 'NoneType'>\n  Given value type: "
            "<class 'str'>\n  Given value: bf17",
            "--precision=bf17 is not one of 'bf16-mixed', '32-true'",
        ),
        (
            "Parser key \"devices\":\n  Expected a <class 'int'>. Got value: two",
            "--devices=two is not a valid int",
        ),
        (
            "Parser key \"config\": File does not exist: 'x.yaml'",
            "--config: File does not exist: 'x.yaml'",
        ),
        ("unrecognized arguments: --train.max_step 3", "unrecognized arguments: --train.max_step 3"),
    ],
)
def test_parser_errors_become_one_line(message: str, line: str) -> None:
    assert argument_error_line(message) == line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--data.prompt_style", "vicuna"], f"--data.prompt_style=vicuna is not one of {choices(PromptStyle)}"),
        (["--data.packing", "maybe"], "--data.packing=maybe is not a valid bool"),
        (["--data.record_shape", "rows"], f"--data.record_shape=rows is not one of {choices(RecordShape)}"),
        (["--precision", "bf17"], f"--precision=bf17 is not one of {choices(Precision)}"),
    ],
)  # fmt: skip
def test_a_bad_value_of_a_data_option_names_that_option(argv: list[str], line: str) -> None:
    """jsonargparse reports `--data.prompt_style vicuna` under `data`, the option holding the data module."""
    from jsonargparse import ArgumentError

    with pytest.raises(ArgumentError) as error:
        CLI(finetune_full.setup, as_positional=True, exit_on_error=False,
            args=["checkpoints/x", "--data", "JSON", "--data.json_path", "a.json", *argv])  # fmt: skip
    assert argument_error_line(str(error.value)) == line


def test_known_options_and_subclass_keys_are_not_blamed() -> None:
    argv = ["checkpoints/x", "--train.max_steps", "3", "--data", "JSON", "--data.json_path", "d.json",
            "--data.init_args.mask_prompt", "false", "--optimizer.lr=1e-4", "--print_config"]  # fmt: skip
    assert explain_parse_error(make_parser, argv) is None


def test_every_unknown_key_of_a_config_is_named_with_its_file(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "train:\n  max_step: 3\n  epochs: 2\n"
        "data:\n  class_path: litsft.data.JSON\n  init_args:\n    json_path: d.json\n    mask_promt: false\n"
    )
    assert explain_parse_error(make_parser, ["checkpoints/x", "--config", str(config)]) == (
        f"--config {config}: unknown key train.max_step; did you mean train.max_steps?; and unknown key "
        "data.mask_promt of --data JSON; did you mean data.mask_prompt?"
    )
    config.write_text("train:\n  max_steps: 3\n  epochs: 2\n")
    assert explain_parse_error(make_parser, ["checkpoints/x", f"--config={config}"]) is None


def test_a_config_that_is_not_yaml_is_named_with_its_line(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  max_steps: 3\n   epochs: 2\n")
    assert explain_parse_error(make_parser, ["checkpoints/x", "--config", str(config), "--zzz", "1"]) == (
        f"--config {config} line 3, column 10: mapping values are not allowed here; fix the YAML syntax there"
    )
    # A missing file is jsonargparse's to name: the unknown option is what is explained here.
    missing = ["checkpoints/x", "--config", str(tmp_path / "missing.yaml"), "--zzz", "1"]
    assert explain_parse_error(make_parser, missing) == "unknown option --zzz; --help lists every option"


def test_data_help_without_a_class_lists_the_classes() -> None:
    assert bare_subclass_help(["checkpoints/x", "--data.help"]) == "data"
    assert bare_subclass_help(["--data.help", "--devices", "2"]) == "data"
    assert bare_subclass_help(["--data.help", "JSON"]) is None
    listed = list_subclasses(make_parser, "data").splitlines()
    assert listed[0] == "--data takes one of these (--data.help NAME lists its options):"
    assert sorted(line.split()[0] for line in listed[1:]) == registered_data_modules()
    assert {"JSON", "HFDataset", "TextFiles"} <= set(registered_data_modules())  # the registry is not empty
    assert list_subclasses(make_parser, "train") is None
