"""litsft/cli/validation.py: the checks before launch, each refusing one wrong run with the value and the fix,
and touching nothing on disk."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from launch import TINY_MOE, write_records
from tiny_tokenizer import write_tiny_tokenizer

from litsft.checkpoint.checkpoint_dirs import CHECKPOINT_FORMAT, TRAINER_STATE
from litsft.cli.validation import check_machine, check_run
from litsft.data import JSON
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.runtime.files import checksum_of_file, write_json
from litsft.training.args import FSDPConfig, RunConfig, TrainConfig, with_defaults


@pytest.fixture
def run(tmp_path: Path) -> RunConfig:
    write_tiny_tokenizer(tmp_path / "tokenizer")
    data = JSON(json_path=write_records(tmp_path / "data.json", count=8))
    config = Config.from_name("tiny-llama")  # vocab 512, context 1024
    return RunConfig(
        config, tmp_path / "tokenizer", data, tmp_path / "out", accelerator="cpu", precision="32-true"
    )


def fake_checkpoint(out_dir: Path, run: RunConfig, **recorded: object) -> Path:
    """A complete checkpoint as far as the checks read one: its trainer_state.json (listing no files)."""
    path = out_dir / "step-00000004"
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "step": 4,
        "recipe": "finetune_full",
        "data": run.data.fingerprint(),
        "config": asdict(run.config),
        "files": [],
        "format": CHECKPOINT_FORMAT,
    }
    write_json(path / TRAINER_STATE, {**state, **recorded})
    return path


def test_a_good_run_passes_and_writes_nothing(run: RunConfig) -> None:
    check_run(run, "finetune_full")
    check_machine(run, gpus=0)
    assert not run.out_dir.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(devices=0), "--devices=0 must be at least 1"),
        (dict(num_nodes=3), "--num_nodes 3 needs a process started on every node"),
        (
            dict(train=TrainConfig(max_seq_length=2048)),
            "max_seq_length=2048 exceeds the model's context length 1024",
        ),
        (dict(data=None), "no data given"),
    ],
)
def test_arguments_refused(run: RunConfig, change: dict, message: str) -> None:
    with pytest.raises(LitsftError, match=message):
        check_run(replace(run, **change), "finetune_full")


def test_balancing_biases_are_refused_for_lora_whose_checkpoints_would_lose_them(run: RunConfig) -> None:
    biased = replace(run, train=TrainConfig(router_bias_update_rate=0.01))
    check_run(biased, "finetune_full")
    with pytest.raises(
        LitsftError, match="^--train.router_bias_update_rate is for finetune_full and pretrain"
    ):
        check_run(biased, "finetune_lora")


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(run: RunConfig) -> None:
    small = replace(run, config=replace(run.config, vocab_size=100))
    with pytest.raises(LitsftError, match=r"has \d+ tokens but the model's vocab_size is 100"):
        check_run(small, "finetune_full")


def test_out_dir_a_file_or_a_finished_run_is_refused(run: RunConfig) -> None:
    run.out_dir.write_text("")
    with pytest.raises(LitsftError, match="is a file; pass a directory"):
        check_run(run, "finetune_full")
    run.out_dir.unlink()
    (run.out_dir / "final").mkdir(parents=True)
    with pytest.raises(LitsftError, match="this run has finished"):
        check_run(run, "finetune_full")
    assert sorted(p.name for p in run.out_dir.iterdir()) == ["final"]


def test_starting_over_on_top_of_checkpoints_is_refused(run: RunConfig) -> None:
    fake_checkpoint(run.out_dir, run)
    with pytest.raises(LitsftError, match="--resume false but .* holds checkpoints of an earlier run"):
        check_run(replace(run, resume=False), "finetune_full")
    check_run(run, "finetune_full")  # --resume auto continues it


@pytest.mark.parametrize(
    ("recorded", "message"),
    [
        (dict(recipe="finetune_lora"), "was written by finetune_lora, not finetune_full"),
        (dict(data="0" * 64), "trained on other data than --data gives now"),
        (
            dict(config={**asdict(Config.from_name("tiny-llama")), "num_layers": 9}),
            r"different model \(num_layers=9",
        ),
    ],
)
def test_resuming_another_recipe_data_or_model_is_refused(
    run: RunConfig, recorded: dict, message: str
) -> None:
    fake_checkpoint(run.out_dir, run, **recorded)
    with pytest.raises(LitsftError, match=message):
        check_run(run, "finetune_full")


def test_a_checkpoint_trained_with_a_load_balancing_weight_of_its_own_resumes_with_it(run: RunConfig) -> None:
    """A checkpoint records the model as the run trained it, --train.router_aux_loss_coef applied: the same
    option resumes it (from out_dir or named by --resume), leaving it out is refused naming the option."""
    moe = replace(
        run, config=Config.from_name("tiny-llama", **TINY_MOE), train=TrainConfig(router_aux_loss_coef=0.1)
    )
    path = fake_checkpoint(moe.out_dir, with_defaults(moe, "32-true"))
    check_run(moe, "finetune_full")
    check_run(replace(moe, resume=path), "finetune_full")
    with pytest.raises(LitsftError) as refused:
        check_run(replace(moe, train=TrainConfig()), "finetune_full")
    assert str(refused.value) == (
        f"{path} was written for a different model (router_aux_loss_coef=0.1, this run has 0.01); pass "
        "--train.router_aux_loss_coef 0.1 as it was trained with, or another --out_dir"
    )


def test_a_checkpoint_whose_trainer_state_records_no_step_is_refused(run: RunConfig) -> None:
    """Valid JSON listing every file, without the step (damaged, or not written by litsft): a traceback
    from the first check that reads the step before."""
    path = fake_checkpoint(run.out_dir, run, step=None)
    with pytest.raises(LitsftError) as refused:
        check_run(run, "finetune_full")
    assert str(refused.value) == (
        f"{path / TRAINER_STATE} records no step, so {path} is damaged; move it aside (rename it) to resume from "
        "the checkpoint before it, or pass --resume <an older step dir>"
    )


def test_an_incomplete_checkpoint_given_to_resume_is_refused(run: RunConfig, tmp_path: Path) -> None:
    (tmp_path / "step-00000001").mkdir()
    with pytest.raises(LitsftError, match="is not a complete litsft training checkpoint"):
        check_run(replace(run, resume=tmp_path / "step-00000001"), "finetune_full")


def test_a_checkpoint_named_by_resume_whose_bytes_changed_is_refused_before_launch(
    run: RunConfig, tmp_path: Path
) -> None:
    """Its sizes pass; its checksum does not. Not moved aside: the run would not go on from the one named."""
    path = tmp_path / "other-run" / "step-00000004"
    path.mkdir(parents=True)
    (path / "rank-00000.safetensors").write_bytes(b"state")
    fake_checkpoint(
        tmp_path / "other-run",
        run,
        files=["rank-00000.safetensors"],
        file_sizes={"rank-00000.safetensors": 5},
        file_checksums={"rank-00000.safetensors": checksum_of_file(path / "rank-00000.safetensors")},
    )
    check_run(replace(run, resume=path), "finetune_full")
    (path / "rank-00000.safetensors").write_bytes(b"stale")
    with pytest.raises(LitsftError) as refused:
        check_run(replace(run, resume=path), "finetune_full")
    assert str(refused.value) == (
        f"--resume {path} is damaged: rank-00000.safetensors does not hold the bytes it was written with (its "
        "checksum differs); pass an older step dir, or --resume auto to go on from the newest intact checkpoint "
        "of --out_dir"
    )
    assert path.is_dir()


def test_resuming_an_earlier_step_into_an_out_dir_with_later_checkpoints_is_refused(
    run: RunConfig, tmp_path: Path
) -> None:
    """Its steps would reach a checkpoint out_dir holds already and fail there; each relaunch alike."""
    earlier = fake_checkpoint(tmp_path / "other-run", run, step=2)
    later = fake_checkpoint(run.out_dir, run)
    damaged = run.out_dir / "step-00000006"  # moved aside when the run starts: no clash
    damaged.mkdir()
    with pytest.raises(LitsftError) as refused:
        check_run(replace(run, resume=earlier), "finetune_full")
    assert str(refused.value) == (
        f"--resume {earlier} starts at step 2 but {run.out_dir} holds checkpoints of later steps "
        f"(step-00000004), which this run would write again; move them out of {run.out_dir} to go on from "
        "step 2 there, or pass another --out_dir"
    )
    check_run(replace(run, resume=later), "finetune_full")  # the newest of out_dir itself, or auto
    check_run(replace(run, resume=earlier, out_dir=tmp_path / "new"), "finetune_full")


@pytest.mark.parametrize(
    ("change", "gpus", "message"),
    [
        (
            dict(accelerator="cuda", devices=4),
            2,
            "--devices 4 asks for 4 GPUs per node but this machine has 2",
        ),
        (dict(precision="16-mixed"), 0, "--precision 16-mixed needs a CUDA GPU"),
        (dict(fsdp=FSDPConfig(cpu_offload=True)), 0, "--fsdp.cpu_offload needs GPUs"),
    ],
)
def test_what_the_machine_cannot_give_is_refused(
    run: RunConfig, change: dict, gpus: int, message: str
) -> None:
    with pytest.raises(LitsftError, match=message):
        check_machine(replace(run, **change), gpus)


# ---- the data, before the model is converted -----------------------------------------------------------
def _bad_data(root: Path) -> dict[str, tuple[list[str], str]]:
    """Data a run would fail on, as --data options, each with the start of the line that refuses it."""
    (root / "qa.jsonl").write_text('{"question": "Hi", "answer": "Hello"}\n')
    (root / "shapeless.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"query": "q"}\n')
    call = {"function": {"name": "get", "arguments": "{not json"}}
    tool_call = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]}]}
    (root / "calls.jsonl").write_text("\n".join(json.dumps(tool_call) for _ in range(40)))
    return {
        "columns of no shape": (
            ["--data", "HFDataset", "--data.path", str(root / "qa.jsonl")],
            f"{root / 'qa.jsonl'} split train has no column of any record shape (its columns: 'question', 'answer')",
        ),
        "no such split": (
            [
                "--data",
                "HFDataset",
                "--data.path",
                str(root),
                "--data.data_files",
                '["qa.jsonl"]',
                "--data.split",
                "test",
            ],
            f"{root} has no split 'test': Unknown split \"test\". Should be one of ['train'].; pass --data.split",
        ),  # fmt: skip
        "a record of no shape": (
            ["--data", "JSON", "--data.json_path", str(root / "shapeless.jsonl")],
            f"{root / 'shapeless.jsonl'} line 2: the record fits no record shape (its fields: 'query')",
        ),
        "no record the template can train on": (
            ["--data", "JSON", "--data.json_path", str(root / "calls.jsonl")],
            "none of the first 32 training records can be trained on with the checkpoint chat template; the "
            f"first: {root / 'calls.jsonl'} line 1 (record 1): message 1 tool_calls[0] (get) has arguments",
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["columns of no shape", "no such split", "a record of no shape", "no record the template can train on"],
)
def test_bad_data_is_refused_before_the_model_is_converted(case: str, tmp_path: Path, capsys) -> None:
    """A Hugging Face model folder is converted on first use (seconds to minutes for a real model): data that
    training would fail on is refused first, in one line, with nothing converted and no out_dir written."""
    from launch import litsft_in_process
    from tiny_hf import save_tiny_hf, tiny_hf_model

    hf_dir = save_tiny_hf(tiny_hf_model("llama"), tmp_path / "hf" / "tiny")
    options, line = _bad_data(tmp_path)[case]
    args = [
        "finetune_full",
        str(hf_dir),
        "--out_dir",
        str(tmp_path / "out"),
        *options,
        "--accelerator",
        "cpu",
    ]
    result = litsft_in_process(args, tmp_path, capsys, check=False)
    assert result.returncode == 2
    # `datasets` draws a progress bar on stderr as it reads the files; then the one line.
    *progress, last = result.stderr.rstrip("\n").split("\n")
    assert last.startswith(f"error: {line}"), result.stderr
    assert all(bar.startswith("\rGenerating train split") for bar in progress), result.stderr
    assert not (tmp_path / "cache" / "converted").exists()  # launch.test_env's LITSFT_CACHE_DIR
    assert not (tmp_path / "out").exists()
