"""A step checkpoint is a model: every command that reads one (convert_to_hf, merge_lora, generate, plan, the
training commands) given `out_dir/step-XXXXXXXX` reads exactly what final/ of a run that ended at that step
holds: the same files, tensors of the same names, dtypes and values (max difference 0.0). Each run here
saves its last step, so its final/ is the model of a run that ended at that step (as in
tests/test_bad_inputs.py); a damaged or incomplete step checkpoint is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from launch import max_difference, write_records, write_tiny_checkpoint
from safetensors.torch import load_file

from litsft.__main__ import main
from litsft.checkpoint.checkpoint_dirs import TOKENIZER_DIR, TRAINER_STATE, find_damage
from litsft.checkpoint.model_cache import open_step_checkpoint
from litsft.checkpoint.step_model import write_step_model
from litsft.data import write_demo_corpus
from litsft.errors import LitsftError
from litsft.huggingface.model_source import resolve_checkpoint
from litsft.runtime.preemption import PreemptionFlag

STEP = "step-00000002"


pytestmark = pytest.mark.usefixtures("fresh_cli_process")


def training(root: Path, command: str, model: Path | str, out_dir: Path, steps: int = 2) -> list[str]:
    """A short run on the data in `root`; pretraining reads the tokenizer of `model` when it is a folder."""
    data = (
        ["--data", "TextFiles", "--data.train_data_path", str(root / "corpus")]
        if command == "pretrain"
        else [
            "--data",
            "JSON",
            "--data.json_path",
            str(root / "data.json"),
            "--data.val_split_fraction",
            "0.2",
        ]
    )
    if model == "tiny-llama":
        data += ["--tokenizer_dir", str(root / "base")]
    return [
        command, str(model), "--out_dir", str(out_dir), *data, "--train.global_batch_size", "2",
        "--train.micro_batch_size", "2", "--train.max_steps", str(steps), "--train.save_interval", "2",
        "--train.max_seq_length", "64", "--optimizer.warmup_steps", "0", "--precision", "32-true",
        "--eval.max_new_tokens", "0", "--accelerator", "cpu",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base stored in bfloat16 (so final/ casts the fp32 weights training holds) and a finished 2-step run
    of each recipe, each with the checkpoint of its last step."""
    root = tmp_path_factory.mktemp("step-model")
    write_tiny_checkpoint(root / "base", seed=1, torch_dtype="bfloat16")
    write_records(root / "data.json", count=24)
    write_demo_corpus(root / "corpus", num_examples=200, num_files=2)
    old = os.environ.get("LITSFT_CACHE_DIR")
    os.environ["LITSFT_CACHE_DIR"] = str(root / "cache")
    try:
        for command in ("finetune_full", "finetune_lora"):
            main(training(root, command, root / "base", root / command))
        main(training(root, "pretrain", "tiny-llama", root / "pretrain"))
    finally:
        PreemptionFlag.uninstall()
        os.environ.pop("LITSFT_CACHE_DIR") if old is None else os.environ.__setitem__("LITSFT_CACHE_DIR", old)
    for command in ("finetune_full", "finetune_lora", "pretrain"):
        assert (root / command / "final").is_dir() and (root / command / STEP).is_dir()
    return root


def assert_same_folder(folder: Path, expected: Path) -> None:
    """The same files; safetensors files hold the same tensors (names, dtypes, values), other files the same
    bytes, where they name their own folder (a PEFT export names the base it writes inside) apart."""
    names = sorted(p.relative_to(expected) for p in expected.rglob("*") if p.is_file())
    assert sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file()) == names
    for name in names:
        if name.suffix == ".safetensors":
            got, want = load_file(folder / name), load_file(expected / name)
            assert got.keys() == want.keys(), name
            for key in want:
                assert got[key].dtype == want[key].dtype, key
                assert torch.equal(got[key], want[key]), key  # max difference 0.0
        else:
            own = (folder / name).read_bytes().replace(str(folder).encode(), str(expected).encode())
            assert own == (expected / name).read_bytes(), name


def cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        PreemptionFlag.uninstall()
    out, err = capsys.readouterr()
    return code, out, err


def assert_generates_the_same(step: Path, final: Path, capsys: pytest.CaptureFixture) -> None:
    """`litsft generate` prints the same greedy text from the step as from final/."""
    generated = [
        cli(
            ["generate", str(model), "--prompt", "alpha beta", "--max_new_tokens", "5", "--chat", "false"],
            capsys,
        )
        for model in (step, final)
    ]
    assert generated[0][0] == 0 and generated[0][1] == generated[1][1]


def refusal(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code, _, err = cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("recipe", ["finetune_full", "pretrain"])
def test_a_full_models_step_opens_as_its_final_folder_and_every_command_reads_it(
    runs: Path, recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    step, final = runs / recipe / STEP, runs / recipe / "final"
    opened = resolve_checkpoint(step)
    assert (
        f"Model: step 2 of a {recipe} run, {step}, written once as a model into {opened}"
        in capsys.readouterr().out
    )
    assert_same_folder(opened, final)
    if recipe == "finetune_full":
        assert load_file(opened / "model.safetensors")["embed.weight"].dtype == torch.bfloat16  # the config's
    written = {p: p.stat().st_mtime_ns for p in opened.iterdir()}
    assert resolve_checkpoint(step) == opened and "reusing its model" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in opened.iterdir()} == written  # not written again

    for model, out in ((step, "from-step"), (final, "from-final")):
        cli(["convert_to_hf", str(model), "--out_dir", str(tmp_path / f"{out}-hf")], capsys)
    assert_same_folder(tmp_path / "from-step-hf", tmp_path / "from-final-hf")
    assert_generates_the_same(step, final, capsys)
    planned = [cli(["plan", str(model), "--device_memory", "1GB"], capsys)[1] for model in (step, final)]
    assert planned[0] == planned[1] and "parameters" in planned[0]
    # A training command started from the step trains what it would from final/.
    for model, out in ((step, "from-step"), (final, "from-final")):
        assert cli(training(runs, recipe, model, tmp_path / out, steps=1), capsys)[0] == 0
    assert max_difference(tmp_path / "from-step" / "final", tmp_path / "from-final" / "final") == 0.0


def test_a_lora_step_opens_as_its_final_adapters_over_the_base(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    step, final = runs / "finetune_lora" / STEP, runs / "finetune_lora" / "final"
    assert_same_folder(open_step_checkpoint(step), final)  # adapters, lora_config.json, tokenizer files
    for model, out in ((step, "from-step"), (final, "from-final")):
        for how in ("merged", "peft"):
            argv = [
                "convert_to_hf",
                str(model),
                "--out_dir",
                str(tmp_path / f"{out}-{how}"),
                "--lora_format",
                how,
            ]
            assert cli(argv, capsys)[0] == 0
    for how in ("merged", "peft"):
        assert_same_folder(tmp_path / f"from-step-{how}", tmp_path / f"from-final-{how}")
    assert cli(["merge_lora", str(step)], capsys)[0] == 0  # beside the step, not in it
    assert cli(["merge_lora", str(final), "--out_dir", str(tmp_path / "final-merged")], capsys)[0] == 0
    assert_same_folder(step.with_name(f"{STEP}-merged"), tmp_path / "final-merged")
    assert find_damage(step) is None
    assert_generates_the_same(step, final, capsys)
    line = refusal(training(runs, "finetune_full", step, tmp_path / "out"), capsys)
    assert f"{step} is a step checkpoint of a finetune_lora run: adapters over a base model" in line
    assert f"`litsft merge_lora {step} --out_dir <dir>`" in line
    shutil.rmtree(step.with_name(f"{STEP}-merged"))


def test_a_damaged_or_incomplete_step_is_refused_in_one_line_and_nothing_is_cached(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    truncated = Path(shutil.copytree(runs / "finetune_full" / STEP, tmp_path / "a" / STEP))
    shard = next((truncated / "shards").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])
    line = refusal(["convert_to_hf", str(truncated), "--out_dir", str(tmp_path / "hf")], capsys)
    assert f"{truncated} is not a complete step checkpoint (shards/{shard.name} is truncated" in line

    overwritten = Path(shutil.copytree(runs / "finetune_full" / STEP, tmp_path / "b" / STEP))
    shard = next((overwritten / "shards").glob("*.safetensors"))
    shard.write_bytes(b"\xff" * 8 + shard.read_bytes()[8:])  # same size: the size check lets it through
    line = refusal(["generate", str(overwritten), "--prompt", "a"], capsys)
    assert (
        f"{overwritten} is not a complete step checkpoint (shards/{shard.name} does not hold the bytes"
        in line
    )
    assert line.endswith("pass another step checkpoint of that run, or its final/")

    flipped = Path(shutil.copytree(runs / "finetune_full" / STEP, tmp_path / "c" / STEP))
    shard = max((flipped / "shards").glob("*.safetensors"), key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(255 - byte for byte in data[-64:])  # inside a tensor: header and size intact
    shard.write_bytes(bytes(data))
    line = refusal(["convert_to_hf", str(flipped), "--out_dir", str(tmp_path / "hf")], capsys)
    assert (
        f"{flipped} is not a complete step checkpoint (shards/{shard.name} does not hold the bytes it was "
        "written with (its checksum differs))" in line
    )
    assert not (tmp_path / "cache" / "converted").exists() or not any(
        (tmp_path / "cache" / "converted").iterdir()
    )
    assert not (tmp_path / "hf").exists()


def test_a_lora_step_over_a_changed_base_is_refused(runs: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(runs / "finetune_lora", tmp_path / "run"))
    base = write_tiny_checkpoint(tmp_path / "other-base", seed=7, torch_dtype="bfloat16")
    state = (run / STEP / "trainer_state.json").read_text().replace(str((runs / "base").resolve()), str(base))
    (run / STEP / "trainer_state.json").write_text(state)  # the run as if trained over `base`
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(LitsftError, match=f"the weights in {base} changed since the adapters in"):
        write_step_model(run / STEP, out)


def test_a_step_written_before_its_folders_were_recorded_reads_the_runs_arguments(
    runs: Path, tmp_path: Path
) -> None:
    """Checkpoints of earlier litsft versions record the run's arguments only: the model folder given there
    (absolute here) gives the tokenizer files, and a folder no longer there is named in one line."""
    step = Path(shutil.copytree(runs / "finetune_full" / STEP, tmp_path / "run" / STEP))
    state = json.loads((step / TRAINER_STATE).read_text())
    assert state.pop(TOKENIZER_DIR) == str((runs / "base").resolve())
    (step / TRAINER_STATE).write_text(json.dumps(state))
    (tmp_path / "out").mkdir()
    write_step_model(step, tmp_path / "out")
    assert_same_folder(tmp_path / "out", runs / "finetune_full" / "final")
    state["arguments"]["checkpoint_dir"] = str(tmp_path / "gone")
    (step / TRAINER_STATE).write_text(json.dumps(state))
    (tmp_path / "again").mkdir()
    with pytest.raises(
        LitsftError, match=f"the tokenizer folder of the run that wrote {step} \\({tmp_path}/gone\\)"
    ):
        write_step_model(step, tmp_path / "again")


def test_a_pissa_step_whose_final_holds_tensors_it_does_not_is_refused_with_the_way_to_its_model(
    runs: Path, tmp_path: Path
) -> None:
    """PiSSA's final/ holds the adapters it started from (derived from the base, not checkpointed)."""
    step = Path(shutil.copytree(runs / "finetune_lora" / STEP, tmp_path / "run" / STEP))
    state = json.loads((step / TRAINER_STATE).read_text())
    state["arguments"]["lora"]["variant"] = "pissa"
    (step / TRAINER_STATE).write_text(json.dumps(state))
    (tmp_path / "out").mkdir()
    with pytest.raises(LitsftError) as refused:
        write_step_model(step, tmp_path / "out")
    assert f"{step} holds the trained adapters of a --lora.variant pissa run but not blocks.0." in str(
        refused.value
    )
    assert f"--resume {step} --train.max_steps 2 --out_dir <a new dir>`" in str(refused.value)
