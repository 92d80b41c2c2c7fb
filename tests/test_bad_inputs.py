"""A catalog of bad inputs, each refused by the CLI with exit status 2 and one `error: ...` line naming the
problem, without a traceback and without changing anything that existed before (checksums of every input
and of pre-populated out_dirs). Every case fails before training starts; they run in-process for speed.
Also: crafted pickles handed to every command that reads weights are refused without being executed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from launch import max_difference, write_records, write_tiny_checkpoint
from safetensors.torch import save_file
from tiny_hf import save_tiny_hf, tiny_hf_model

from litsft.__main__ import main
from litsft.model.config import CONFIG_FILENAME, Config
from litsft.model.lora.layers import LoRAConfig, apply_lora, lora_state_dict
from litsft.model.network.transformer import Transformer
from litsft.runtime.preemption import PreemptionFlag
from litsft.runtime.run_lock import LOCK_NAME, process_start_time

pytestmark = pytest.mark.usefixtures("fresh_cli_process")


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Inputs shared by the cases: a tiny checkpoint, data, and out_dirs of an earlier run."""
    root = tmp_path_factory.mktemp("bad-inputs")
    write_tiny_checkpoint(root / "base", seed=1)
    write_tiny_checkpoint(root / "other-model", seed=1, intermediate_size=96)
    write_records(root / "data.json", count=24)
    write_records(root / "other-data.json", count=24, seed=1)
    (root / "broken.json").write_text('[{"instruction": "a", "output": ')
    (root / "not-a-checkpoint").mkdir()
    (root / "a-file").write_text("not a directory")
    env = {"LITSFT_CACHE_DIR": str(root / "cache")}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        main([*train(root, root / "finished"), "--train.max_steps", "2", "--train.save_interval", "2"])
    finally:
        PreemptionFlag.uninstall()
        for k, v in old_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert (root / "finished" / "final").is_dir() and (root / "finished" / "step-00000002").is_dir()
    shutil.copytree(root / "finished", root / "interrupted", ignore=shutil.ignore_patterns("final"))
    return root


def train(
    ws: Path, out_dir: Path, *extra: str, command: str = "finetune_full", base: str = "base"
) -> list[str]:
    return [
        command, str(ws / base), "--out_dir", str(out_dir), "--data", "JSON",
        "--data.json_path", str(ws / "data.json"), "--data.val_split_fraction", "0.2",
        "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--train.max_steps", "4",
        "--train.max_seq_length", "64", "--precision", "32-true", "--eval.max_new_tokens", "0",
        "--accelerator", "cpu", *extra,
    ]  # fmt: skip


def copy_of(ws: Path, tmp: Path, name: str) -> Path:
    return Path(shutil.copytree(ws / name, tmp / name))


def edit_config(directory: Path, **changes: object) -> Path:
    path = directory / CONFIG_FILENAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return directory


def corrupt_header(path: Path) -> None:
    """Same size, unreadable header: only reading it can tell."""
    data = bytearray(path.read_bytes())
    data[:8] = b"\xff" * 8
    path.write_bytes(bytes(data))


def live_lock(out_dir: Path) -> None:
    """out_dir held by a live run on this host: this test process itself."""
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": process_start_time(os.getpid())}
    (out_dir / LOCK_NAME).write_text(json.dumps({**lock, "started": "2026-01-01 00:00:00"}))


Case = tuple[Callable[[Path, Path], list[str]], str, dict[str, str]]
NO_ENV: dict[str, str] = {}
TORCHRUN_4 = {
    "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
    "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
}  # fmt: skip

CASES: dict[str, Case] = {
    # CLI typos, rejected by the parser.
    "unknown command": (lambda ws, t: ["finetune", str(ws / "base")], "unknown command 'finetune'", NO_ENV),
    "strategy typo": (
        lambda ws, t: train(ws, t / "out", "--fsdp.sharding_strategy", "FULLSHARD"),
        "--fsdp.sharding_strategy=FULLSHARD is not one of 'FULL_SHARD', 'SHARD_GRAD_OP'",
        NO_ENV,
    ),
    "precision typo": (
        lambda ws, t: train(ws, t / "out", "--precision", "bf17-mixed"),
        "--precision=bf17-mixed is not one of",
        NO_ENV,
    ),
    "misspelled option": (
        lambda ws, t: train(ws, t / "out", "--train.max_step", "3"),
        "unknown option --train.max_step; did you mean --train.max_steps?",
        NO_ENV,
    ),
    "misspelled data option": (
        lambda ws, t: train(ws, t / "out", "--data.mask_promt", "false"),
        "error: unknown option --data.mask_promt of --data JSON; did you mean --data.mask_prompt?",
        NO_ENV,
    ),
    "misspelled data key in a config": (
        lambda ws, t: train(
            ws,
            t / "out",
            "--config",
            _config(
                t,
                "data:\n  class_path: JSON\n  init_args:\n    json_path: data.json\n    mask_promt: false\n",
            ),
        ),
        "c.yaml: unknown key data.mask_promt of --data JSON; did you mean data.mask_prompt?",
        NO_ENV,
    ),  # fmt: skip
    "misspelled key in a config": (
        lambda ws, t: train(ws, t / "out", "--config", _config(t, "train:\n  max_step: 3\n")),
        "c.yaml: unknown key train.max_step; did you mean train.max_steps?",
        NO_ENV,
    ),
    "every unknown key of a config": (
        lambda ws, t: train(ws, t / "out", "--config", _config(t, "train:\n  max_step: 3\n  epoch: 2\n")),
        "c.yaml: unknown key train.max_step; did you mean train.max_steps?; and unknown key train.epoch; did "
        "you mean train.epochs?",
        NO_ENV,
    ),
    "misspelled command": (
        lambda ws, t: ["finetune_ful", str(ws / "base")],
        "unknown command 'finetune_ful'; did you mean finetune_full?",
        NO_ENV,
    ),
    "an option by its Hugging Face name": (
        lambda ws, t: train(ws, t / "out", "--optimizer.learning_rate", "1e-4"),
        "unknown option --optimizer.learning_rate; did you mean --optimizer.lr?",
        NO_ENV,
    ),
    "an option without its group": (
        lambda ws, t: train(ws, t / "out", "--lr", "1e-4"),
        "unknown option --lr; did you mean --optimizer.lr?",
        NO_ENV,
    ),
    "the text files option by another name": (
        lambda ws, t: [
            "pretrain",
            "tiny-llama",
            "--tokenizer_dir",
            str(ws / "base"),
            "--data",
            "TextFiles",
            "--data.train_dir",
            str(t),
        ],  # fmt: skip
        "unknown option --data.train_dir of --data TextFiles; did you mean --data.train_data_path?",
        NO_ENV,
    ),
    "a missing directory written as a path": (
        lambda ws, t: ["finetune_full", "./ck/nope", "--data", "Demo"],
        "./ck/nope: no such directory",
        NO_ENV,
    ),
    "config that is not YAML": (
        lambda ws, t: train(ws, t / "out", "--config", _config(t, "train:\n  max_steps: 3\n   epochs: 2\n")),
        "c.yaml line 3, column 10: mapping values are not allowed here; fix the YAML syntax there",
        NO_ENV,
    ),
    "not an int": (
        lambda ws, t: train(ws, t / "out", "--devices", "two"),
        "--devices=two is not a valid int",
        NO_ENV,
    ),
    "unknown data module": (
        lambda ws, t: train(ws, t / "out", "--data", "JSONL"),
        "--data=JSONL is not one of",
        NO_ENV,
    ),
    "missing checkpoint argument": (
        lambda ws, t: ["finetune_full"],
        "the following arguments are required: checkpoint_dir",
        NO_ENV,
    ),
    "missing config file": (
        lambda ws, t: train(ws, t / "out", "--config", str(t / "nothere.yaml")),
        "--config: File does not exist",
        NO_ENV,
    ),
    # Configs that cannot run.
    "indivisible batch": (
        lambda ws, t: train(ws, t / "out", "--train.global_batch_size", "6", "--train.micro_batch_size", "4"),
        "--train.global_batch_size=6 is not divisible by --train.micro_batch_size=4",
        NO_ENV,
    ),
    "zero micro batch": (
        lambda ws, t: train(ws, t / "out", "--train.micro_batch_size", "0"),
        "--train.micro_batch_size=0 must be at least 1",
        NO_ENV,
    ),
    # Hyperparameters that make no sense, refused where they are declared.
    "lora alpha 0": (
        lambda ws, t: train(ws, t / "out", "--lora.alpha", "0", command="finetune_lora"),
        "--lora.alpha=0.0 must be greater than 0; the adapters' output is scaled by alpha / rank",
        NO_ENV,
    ),
    "lora rank 0": (
        lambda ws, t: train(ws, t / "out", "--lora.rank", "0", command="finetune_lora"),
        "--lora.rank=0 must be at least 1; use e.g. 8 or 16",
        NO_ENV,
    ),
    "loraplus ratio without loraplus": (
        lambda ws, t: train(ws, t / "out", "--lora.loraplus_lr_ratio", "4", command="finetune_lora"),
        "--lora.loraplus_lr_ratio applies to --lora.variant loraplus, not lora; drop it or pass --lora.variant loraplus",
        NO_ENV,
    ),
    "loraplus ratio 0": (
        lambda ws, t: train(
            ws,
            t / "out",
            "--lora.variant",
            "loraplus",
            "--lora.loraplus_lr_ratio",
            "0",
            command="finetune_lora",
        ),
        "--lora.loraplus_lr_ratio=0.0 must be greater than 0; use e.g. 16",
        NO_ENV,
    ),
    "pissa over an nf4 base": (
        lambda ws, t: train(
            ws, t / "out", "--lora.variant", "pissa", "--quantize", "nf4", command="finetune_lora"
        ),
        "--lora.variant pissa with --quantize nf4 is not supported: PiSSA trains on the residual of the base "
        "weights, which would have to be quantized after the decomposition; drop --quantize or use --lora.variant lora",
        NO_ENV,
    ),
    "min_lr above lr": (
        lambda ws, t: train(ws, t / "out", "--optimizer.lr", "1e-4", "--optimizer.min_lr", "1e-3"),
        "--optimizer.min_lr=0.001 is above --optimizer.lr=0.0001, so the schedule would rise instead of decay",
        NO_ENV,
    ),
    "warmup fraction above 1": (
        lambda ws, t: train(ws, t / "out", "--optimizer.warmup_fraction", "1.5"),
        "--optimizer.warmup_fraction=1.5 must be at least 0 and at most 1; it is the share of all steps",
        NO_ENV,
    ),
    "negative warmup fraction": (
        lambda ws, t: train(ws, t / "out", "--optimizer.warmup_fraction=-0.1"),
        "--optimizer.warmup_fraction=-0.1 must be at least 0 and at most 1",
        NO_ENV,
    ),
    "lr 0": (
        lambda ws, t: train(ws, t / "out", "--optimizer.lr", "0"),
        "--optimizer.lr=0.0 must be greater than 0; use e.g. 2e-5 (full fine-tuning) or 2e-4 (LoRA)",
        NO_ENV,
    ),
    "negative lr": (
        lambda ws, t: train(ws, t / "out", "--optimizer.lr=-1e-4", command="finetune_lora"),
        "--optimizer.lr=-0.0001 must be greater than 0",
        NO_ENV,
    ),
    "negative weight decay": (
        lambda ws, t: train(ws, t / "out", "--optimizer.weight_decay=-0.1"),
        "--optimizer.weight_decay=-0.1 must be at least 0",
        NO_ENV,
    ),
    "beta of 1": (
        lambda ws, t: train(ws, t / "out", "--optimizer.betas", "[0.9, 1.0]"),
        "--optimizer.betas=1.0 must be at least 0 and less than 1",
        NO_ENV,
    ),
    "clipping at 0": (
        lambda ws, t: train(ws, t / "out", "--train.max_norm", "0"),
        "--train.max_norm=0.0 must be greater than 0; pass null to disable clipping",
        NO_ENV,
    ),
    "zero eval batches": (
        lambda ws, t: train(ws, t / "out", "--eval.max_batches", "0"),
        "--eval.max_batches=0 must be at least 1",
        NO_ENV,
    ),
    "validation share of 1": (
        lambda ws, t: train(ws, t / "out", "--data.val_split_fraction", "1"),
        "--data.val_split_fraction=1.0 must be at least 0 and less than 1",
        NO_ENV,
    ),
    "negative loader workers": (
        lambda ws, t: train(ws, t / "out", "--data.num_workers=-1"),
        "--data.num_workers=-1 must be at least 0",
        NO_ENV,
    ),
    "sequence longer than context": (
        lambda ws, t: train(ws, t / "out", "--train.max_seq_length", "100000"),
        "--train.max_seq_length=100000 exceeds the model's context length",
        NO_ENV,
    ),
    "fp16 on cpu": (
        lambda ws, t: train(ws, t / "out", "--precision", "16-mixed"),
        "--precision 16-mixed needs a CUDA GPU",
        NO_ENV,
    ),
    "float8 on cpu": (
        lambda ws, t: train(ws, t / "out", "--train.float8", "tensorwise"),
        "--train.float8 tensorwise needs a CUDA GPU with float8 tensor cores (compute capability 8.9 or newer",
        NO_ENV,
    ),
    "float8 for lora": (
        lambda ws, t: train(ws, t / "out", "--train.float8", "rowwise", command="finetune_lora"),
        "--train.float8 rowwise is for finetune_full and pretrain: finetune_lora's base weights are frozen",
        NO_ENV,
    ),
    "float8 misspelled": (
        lambda ws, t: train(ws, t / "out", "--train.float8", "rowise"),
        "--train.float8=rowise is not one of 'tensorwise', 'rowwise'",
        NO_ENV,
    ),
    "devices disagree with torchrun": (
        lambda ws, t: train(ws, t / "out", "--devices", "1"),
        "torchrun started 4 processes (2 per node) but --devices 1 x --num_nodes 1 = 1",
        TORCHRUN_4,
    ),
    "no data": (
        lambda ws, t: ["finetune_full", str(ws / "base"), "--out_dir", str(t / "out")],
        "no data given",
        NO_ENV,
    ),
    "pretrain unknown model": (
        lambda ws, t: ["pretrain", "tiny-lama", "--tokenizer_dir", str(ws / "base"), "--data", "Demo"],
        "tiny-lama",
        NO_ENV,
    ),
    # Data.
    "streaming a hub dataset": (
        lambda ws, t: [
            *train(ws, t / "out"),
            "--data",
            "HFDataset",
            "--data.path",
            "org/name",
            "--data.streaming",
            "true",
        ],  # fmt: skip
        "--data.streaming true is not supported: each epoch's batches",
        NO_ENV,
    ),
    "missing data file": (
        lambda ws, t: [*train(ws, t / "out"), "--data.json_path", str(t / "missing.json")],
        "missing.json",
        NO_ENV,
    ),
    "malformed data file": (
        lambda ws, t: [*train(ws, t / "out"), "--data.json_path", str(ws / "broken.json")],
        "broken.json",
        NO_ENV,
    ),
    "a record the chat template cannot mask": (
        lambda ws, t: [
            *train(ws, t / "out", base=str(_dog_template(copy_of(ws, t, "base")))),
            "--data.json_path",
            _records_with_a_cat(t),
            "--data.skip_invalid",
            "false",
        ],
        "data.jsonl line 3 (record 3): the checkpoint chat template does not show assistant message 1 verbatim",
        NO_ENV,
    ),  # fmt: skip
    # Checkpoints.
    "not a checkpoint": (
        lambda ws, t: train(ws, t / "out", base="not-a-checkpoint"),
        "not-a-checkpoint is neither a litsft checkpoint (litsft_config.json is missing) nor a Hugging Face",
        NO_ENV,
    ),
    "config not json": (
        lambda ws, t: train(ws, t / "out", base=str(_broken_config(copy_of(ws, t, "base")))),
        "litsft_config.json is not valid JSON",
        NO_ENV,
    ),
    "weights missing": (
        lambda ws, t: train(ws, t / "out", base=str(_without_weights(copy_of(ws, t, "base")))),
        "base",
        NO_ENV,
    ),
    "weights of another shape": (
        lambda ws, t: train(
            ws, t / "out", base=str(edit_config(copy_of(ws, t, "base"), intermediate_size=96))
        ),
        "does not belong to this model config",
        NO_ENV,
    ),
    "tokenizer larger than vocab": (
        lambda ws, t: train(ws, t / "out", base=str(edit_config(copy_of(ws, t, "base"), vocab_size=100))),
        "tokens but the model's vocab_size is 100",
        NO_ENV,
    ),
    # out_dir clashes and resumes.
    "finished run relaunched": (
        lambda ws, t: train(ws, copy_of(ws, t, "finished")),
        "final exists: this run has finished; pass another --out_dir",
        NO_ENV,
    ),
    "fresh start over checkpoints": (
        lambda ws, t: train(ws, copy_of(ws, t, "interrupted"), "--resume", "false"),
        "--resume false but",
        NO_ENV,
    ),
    "out_dir held by a live run": (
        lambda ws, t: train(ws, _locked(copy_of(ws, t, "interrupted"))),
        "is in use by a running litsft run (host",
        NO_ENV,
    ),
    "out_dir is a file": (
        lambda ws, t: train(ws, ws / "a-file"),
        "a-file is a file; pass a directory",
        NO_ENV,
    ),
    "resume path missing": (
        lambda ws, t: train(ws, t / "out", "--resume", str(t / "step-00000009")),
        "no such checkpoint directory",
        NO_ENV,
    ),
    "resume another model": (
        lambda ws, t: train(ws, copy_of(ws, t, "interrupted"), base="other-model"),
        "was written for a different model (intermediate_size=",
        NO_ENV,
    ),
    "resume another recipe": (
        lambda ws, t: train(ws, copy_of(ws, t, "interrupted"), command="finetune_lora"),
        "was written by finetune_full, not finetune_lora",
        NO_ENV,
    ),
    "resume with another data file": (
        lambda ws, t: train(
            ws, copy_of(ws, t, "interrupted"), "--data.json_path", str(ws / "other-data.json")
        ),
        "was trained on other data than --data gives now (data fingerprint ",
        NO_ENV,
    ),
    # --resume auto moves a damaged checkpoint aside and goes on from the one before (test_fault_injection.py);
    # one the user names is refused, its bytes checked against their checksums before launch.
    "resume a named checkpoint with a damaged shard": (
        lambda ws, t: train(
            ws, _damaged(copy_of(ws, t, "interrupted")), "--resume", str(t / "interrupted" / "step-00000002")
        ),
        "step-00000002 is damaged: shards/shard-00001-model-00001-of-00001.safetensors does not hold the bytes "
        "it was written with (its checksum differs)",
        NO_ENV,
    ),
    "resume a checkpoint of the earlier row format": (
        lambda ws, t: train(ws, _in_row_format(copy_of(ws, t, "interrupted"))),
        "is in litsft's earlier row-sharded checkpoint format, which this version no longer reads; finish "
        "that run with the litsft that wrote it, or start this one in another --out_dir",
        NO_ENV,
    ),
    "resume a run's out_dir": (
        lambda ws, t: train(ws, t / "out", "--resume", str(ws / "interrupted")),
        "interrupted is a run's out_dir, not one of its step checkpoints; pass ",
        NO_ENV,
    ),
    "resume an earlier step over later checkpoints": (
        lambda ws, t: train(
            ws, _with_a_later_step(ws, t), "--resume", str(ws / "interrupted" / "step-00000002")
        ),
        "step-00000002 starts at step 2 but ",
        NO_ENV,
    ),
    "resume a finished model": (
        lambda ws, t: train(ws, t / "out", "--resume", str(ws / "finished" / "final")),
        "final is a model folder, not a training checkpoint (it has no trainer_state.json)",
        NO_ENV,
    ),
    "train from an incomplete step checkpoint": (
        lambda ws, t: train(ws, t / "out", base=str(_truncated(copy_of(ws, t, "interrupted")))),
        "step-00000002 is not a complete step checkpoint (shards/shard-00001-model-00001-of-00001.safetensors "
        "is truncated",
        NO_ENV,
    ),
    "resume an incomplete checkpoint": (
        lambda ws, t: train(ws, t / "out", "--resume", str(_truncated(copy_of(ws, t, "interrupted")))),
        "is not a complete litsft training checkpoint",
        NO_ENV,
    ),
    # Other commands.
    "generate without checkpoint": (
        lambda ws, t: ["generate", str(ws / "not-a-checkpoint")],
        "not-a-checkpoint is neither a litsft checkpoint (litsft_config.json is missing) nor a Hugging Face",
        NO_ENV,
    ),
    "convert into an unwritable place": (
        lambda ws, t: ["convert_to_hf", str(ws / "base"), "--out_dir", str(ws / "a-file" / "hf")],
        "a-file/hf (Not a directory: ",
        NO_ENV,
    ),
    "convert an incomplete step checkpoint": (
        lambda ws, t: [
            "convert_to_hf",
            str(_truncated(copy_of(ws, t, "interrupted"))),
            "--out_dir",
            str(t / "hf"),
        ],
        "step-00000002 is not a complete step checkpoint (shards/shard-00001-model-00001-of-00001.safetensors "
        "is truncated",
        NO_ENV,
    ),
    "generate from a run's out_dir": (
        lambda ws, t: ["generate", str(ws / "finished")],
        "finished is a run's out_dir; pass ",
        NO_ENV,
    ),
    "PEFT export of a full model": (
        lambda ws, t: [
            "convert_to_hf",
            str(ws / "base"),
            "--out_dir",
            str(t / "peft"),
            "--lora_format",
            "peft",
        ],
        "is a full model, not a LoRA checkpoint (it has no lora_config.json)",
        NO_ENV,
    ),
    "convert into a non-empty dir": (
        lambda ws, t: ["convert_to_hf", str(ws / "base"), "--out_dir", str(copy_of(ws, t, "interrupted"))],
        "already exists and is not empty",
        NO_ENV,
    ),
}


def _dog_template(directory: Path) -> Path:
    """A chat template that marks the last message with its own header and writes "cat" as "dog"."""
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{% set head = 'final' if loop.last else m['role'] %}"
        "{{ '<|im_start|>' + head + '\\n' + m['content'].replace('cat', 'dog') + '<|im_end|>\\n' }}{% endfor %}"
    )
    return directory


def _records_with_a_cat(directory: Path) -> str:
    outputs = ["one", "two", "the cat", "four"]
    lines = [json.dumps({"instruction": f"say {output}", "output": output}) for output in outputs]
    (directory / "data.jsonl").write_text("\n".join(lines))
    return str(directory / "data.jsonl")


def _config(directory: Path, text: str) -> str:
    (directory / "c.yaml").write_text(text)
    return str(directory / "c.yaml")


def _broken_config(directory: Path) -> Path:
    (directory / CONFIG_FILENAME).write_text("{")
    return directory


def _without_weights(directory: Path) -> Path:
    (directory / "model.safetensors").unlink()
    return directory


def _locked(out_dir: Path) -> Path:
    live_lock(out_dir)
    return out_dir


def _damaged(out_dir: Path) -> Path:
    corrupt_header(out_dir / "step-00000002" / "shards" / "shard-00001-model-00001-of-00001.safetensors")
    return out_dir


def _with_a_later_step(ws: Path, tmp: Path) -> Path:
    """An out_dir holding a complete checkpoint named step 4 (a copy of the earlier run's step 2)."""
    out_dir = tmp / "later"
    shutil.copytree(ws / "interrupted" / "step-00000002", out_dir / "step-00000004")
    return out_dir


def _in_row_format(out_dir: Path) -> Path:
    """What litsft wrote before torch.distributed.checkpoint: no `format` in trainer_state.json."""
    state_path = out_dir / "step-00000002" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    del state["format"]
    state_path.write_text(json.dumps(state))
    return out_dir


def _truncated(out_dir: Path) -> Path:
    shard = out_dir / "step-00000002" / "shards" / "shard-00001-model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    return out_dir / "step-00000002"


def snapshot(*roots: Path) -> dict[str, str]:
    """Every file's checksum and every directory, under the roots (data caches excepted)."""
    state = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if "cache" in path.relative_to(root).parts:
                continue
            key = str(path)
            state[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_in_one_line_and_changes_nothing(
    name: str, ws: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_argv, expected, env = CASES[name]
    argv = make_argv(ws, tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = snapshot(ws, tmp_path)
    code, stderr = run_cli(argv, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0], lines[0]
    assert snapshot(ws, tmp_path) == before


def test_the_catalog_has_at_least_25_cases() -> None:
    assert len(CASES) >= 25


def test_a_stale_lock_from_a_dead_run_is_taken_over(
    ws: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out_dir = copy_of(ws, tmp_path, "interrupted")
    lock = {"host": socket.gethostname(), "pid": dead.pid, "start_time": 1, "started": "2026-01-01 00:00:00"}
    (out_dir / LOCK_NAME).write_text(json.dumps(lock))
    main(train(ws, out_dir))
    output = capsys.readouterr().out
    assert (
        f"Taking over {out_dir / LOCK_NAME} from a run that is gone (host {socket.gethostname()}, pid {dead.pid}"
        in output
    )
    assert "Resumed from" in output
    assert (out_dir / "final").is_dir() and not (out_dir / LOCK_NAME).exists()


# ---- crafted pickles ---------------------------------------------------------------------------------------
class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def evil_checkpoint(ws: Path, tmp: Path, marker: Path) -> Path:
    """A litsft checkpoint whose weights are a pytorch_model.bin that runs code when unpickled."""
    directory = copy_of(ws, tmp, "base")
    (directory / "model.safetensors").unlink()
    torch.save({"embed.weight": Payload(marker)}, directory / "pytorch_model.bin")
    return directory


def evil_lora_checkpoint(ws: Path, tmp: Path, marker: Path) -> Path:
    """A valid LoRA checkpoint whose base checkpoint is `evil_checkpoint`."""
    base = evil_checkpoint(ws, tmp, marker)
    lora = LoRAConfig(targets=["q"])
    adapters = lora_state_dict(apply_lora(Transformer(Config.from_checkpoint(base)), lora))
    lora_dir = tmp / "lora"
    lora_dir.mkdir()
    save_file({k: v.contiguous() for k, v in adapters.items()}, lora_dir / "adapter.safetensors")
    (lora_dir / "lora_config.json").write_text(json.dumps({**asdict(lora), "base_checkpoint": str(base)}))
    return lora_dir


def evil_hf_checkpoint(ws: Path, tmp: Path, marker: Path) -> Path:
    directory = save_tiny_hf(tiny_hf_model("llama"), tmp / "hf", bin_shards=1)
    torch.save({"model.embed_tokens.weight": Payload(marker)}, directory / "pytorch_model.bin")
    return directory


def evil_resume(ws: Path, tmp: Path, marker: Path) -> Path:
    """A checkpoint as litsft wrote them before rank files were safetensors (rank-00000.pt, no checksums),
    its rank file a crafted pickle."""
    out_dir = copy_of(ws, tmp, "interrupted")
    checkpoint = out_dir / "step-00000002"
    (checkpoint / "rank-00000.safetensors").unlink()
    torch.save({"rng": Payload(marker)}, checkpoint / "rank-00000.pt")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["file_checksums"], state["file_sizes"]["rank-00000.safetensors"]
    state["files"] = sorted(["rank-00000.pt", *(f for f in state["files"] if f != "rank-00000.safetensors")])
    state["file_sizes"]["rank-00000.pt"] = (checkpoint / "rank-00000.pt").stat().st_size
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    return out_dir


PICKLE_COMMANDS: dict[str, Callable[[Path, Path, Path], list[str]]] = {
    "convert_from_hf": lambda ws, t, m: ["convert_from_hf", str(evil_hf_checkpoint(ws, t, m)), "--out_dir", str(t / "o")],
    "finetune_full": lambda ws, t, m: train(ws, t / "out", base=str(evil_checkpoint(ws, t, m))),
    "finetune_lora": lambda ws, t, m: train(ws, t / "out", base=str(evil_checkpoint(ws, t, m)), command="finetune_lora"),
    "generate": lambda ws, t, m: ["generate", str(evil_checkpoint(ws, t, m)), "--max_new_tokens", "2"],
    "merge_lora": lambda ws, t, m: ["merge_lora", str(evil_lora_checkpoint(ws, t, m)), "--out_dir", str(t / "o")],
    "convert_to_hf": lambda ws, t, m: ["convert_to_hf", str(evil_checkpoint(ws, t, m)), "--out_dir", str(t / "o")],
    "resume": lambda ws, t, m: train(ws, evil_resume(ws, t, m)),
}  # fmt: skip


def test_the_crafted_pickle_is_live(tmp_path: Path) -> None:
    """Without weights_only the payload runs: the refusals below are not vacuous."""
    marker = tmp_path / "ran"
    torch.save({"w": Payload(marker)}, tmp_path / "evil.bin")
    torch.load(tmp_path / "evil.bin", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("command", list(PICKLE_COMMANDS))
def test_crafted_pickle_is_refused_without_running(
    command: str, ws: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    argv = PICKLE_COMMANDS[command](ws, tmp_path, marker)
    code, stderr = run_cli(argv, capsys)
    assert not marker.exists(), f"{command} executed the pickle"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, stderr
    assert "refuses to unpickle" in lines[0] and "posix.system" in lines[0], lines[0]


def test_a_resume_to_a_steps_own_step_writes_that_steps_model(ws: Path, tmp_path: Path) -> None:
    """Resumed into a new out_dir with its own step as the last, a step checkpoint writes, without training
    a step, the model the run had there (the way a PiSSA run's step is named: its final/ holds tensors the
    checkpoint does not): here the model of a run that ended there."""
    step = ws / "interrupted" / "step-00000002"
    main(train(ws, tmp_path / "step-model", "--resume", str(step), "--train.max_steps", "2"))
    assert max_difference(tmp_path / "step-model" / "final", ws / "finished" / "final") == 0.0


def test_a_resume_with_another_learning_rate_says_so_in_one_line(
    ws: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Accepted (lowering the rate on resume is a common fix), but never silently: the rate would jump."""
    out_dir = copy_of(ws, tmp_path, "interrupted")
    main(train(ws, out_dir, "--train.max_steps", "3", "--optimizer.lr", "1e-4"))
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Resuming ")]
    assert notices == [
        f"Resuming {out_dir / 'step-00000002'} with other settings than it was trained with (--optimizer.lr "
        "2e-05 -> 0.0001, --train.max_steps 2 -> 3): they apply from step 2 on, so the learning rate may "
        "jump there"
    ]
