"""Crashing a 2-process FULL_SHARD run at named moments and relaunching it (tests and benchmarks share this).

Each crash is deterministic: LITSFT_FAULT_AT names a `fault_point` in the engine or checkpoint code, and
the run SIGKILLs its whole process group there (both ranks die at once, as when a node is lost). Every run
starts in a session of its own, so the kill never reaches the test process.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from launch import DEADLINE_S, free_port, test_env

from litsft.runtime.faults import FAULT_ENV

# Ten moments, in the order a run reaches them (8 steps, a checkpoint every 2, the newest 2 kept).
# "@1": on rank 1 (rank 0 by default).
FAULT_POINTS = [
    "after_step_1",  # before any checkpoint: the relaunch starts over
    "save_2_started",  # the partial directory exists, no file in it yet
    "save_4_writing@1",  # rank 0's shards are written or being written, rank 1's not yet
    "save_4_shards_written@1",  # both ranks' shards on disk, trainer_state.json not yet
    "save_4_before_rename",  # trainer_state.json written, not yet published
    "save_4_after_rename",  # published, older checkpoints not yet rotated
    "rotate_step-00000002",  # step-2 renamed for deletion, not yet deleted
    "after_step_7",  # mid-way between checkpoints: step 7 is trained again after the relaunch
    "before_final",  # every step done and saved, final/ not yet written
    "final_before_rename",  # final/ written under a temporary name, not yet published
]


def train_args(
    base: Path, data: Path | list[str], out_dir: Path, *extra: str, recipe: str = "finetune_full"
) -> list[str]:
    """`recipe` on `base`; `data` is a JSON file, or the --data options of any data module."""
    if isinstance(data, Path):
        data = ["--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0.1"]
    return [
        recipe, str(base), "--out_dir", str(out_dir), "--devices", "2", "--accelerator", "cpu",
        "--fsdp.sharding_strategy", "FULL_SHARD", "--precision", "32-true", "--train.deterministic", "true",
        *data, "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_steps", "8",
        "--train.max_seq_length", "64", "--train.save_interval", "2", "--train.keep_last", "2",
        "--optimizer.lr", "1e-3", "--optimizer.warmup_steps", "2", "--eval.max_new_tokens", "0", *extra,
    ]  # fmt: skip


def write_data_inputs(root: Path, base: Path) -> None:
    """Small inputs for every data module under `root` (see `data_options`), tokenized with `base`'s tokenizer."""
    import datasets
    from launch import write_records
    from tiny_datasets import sharegpt_rows

    from litsft.data import write_demo_corpus
    from litsft.data.prepare import prepare

    root.mkdir(parents=True, exist_ok=True)
    write_records(root / "data.json")
    datasets.Dataset.from_list(sharegpt_rows(48)).to_parquet(root / "records.parquet")
    write_demo_corpus(root / "corpus", num_examples=300, num_files=3)
    prepare(root / "corpus", root / "litdata", base, val_fraction=0.3, num_workers=1)


# Each data module: the recipe that trains on it and its options, on the inputs of `write_data_inputs`.
DATA_MODULES: dict[str, tuple[str, list[str]]] = {
    "JSON": ("finetune_full", ["--data", "JSON", "--data.json_path", "{root}/data.json"]),
    "Demo": (
        "finetune_full",
        ["--data", "Demo", "--data.num_train", "64", "--data.num_val", "8", "--data.num_eval", "2"],
    ),  # fmt: skip
    "HFDataset": ("finetune_full", ["--data", "HFDataset", "--data.path", "{root}/records.parquet"]),
    "TextFiles": ("pretrain", ["--data", "TextFiles", "--data.train_data_path", "{root}/corpus"]),
    "LitData": ("pretrain", ["--data", "LitData", "--data.path", "{root}/litdata"]),
}


def data_options(module: str, root: Path) -> tuple[str, list[str]]:
    recipe, options = DATA_MODULES[module]
    return recipe, [option.format(root=root) for option in options]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_litsft(
    args: list[str],
    workdir: Path,
    fault: str | None = None,
    timeout: float = DEADLINE_S,
    preexec_fn: Callable[[], None] | None = None,
) -> Run:
    """`python -m litsft ...` in a new session; with `fault`, LITSFT_FAULT_AT=fault."""
    env = test_env(workdir)
    env["MASTER_PORT"] = str(free_port())
    if fault is not None:
        env[FAULT_ENV] = fault
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "litsft", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    return Run(result.returncode, result.stdout, result.stderr, time.perf_counter() - start)


def crash_and_recover(args: list[str], workdir: Path, faults: list[str]) -> list[Run]:
    """Crash the run at each fault in turn (each relaunch resumes from what the previous crash left), then
    relaunch once more without faults. Returns every run; raises if a fault did not fire or the last run
    failed."""
    runs = []
    for fault in faults:
        run = run_litsft(args, workdir, fault)
        runs.append(run)
        if run.returncode != -9:
            raise AssertionError(
                f"fault {fault} did not kill the run (exit {run.returncode}):\n{run.stderr[-3000:]}"
            )
    run = run_litsft(args, workdir)
    runs.append(run)
    if run.returncode != 0:
        raise AssertionError(f"the relaunch after {faults} exited {run.returncode}:\n{run.stderr[-3000:]}")
    return runs


def logged_steps(out_dir: Path) -> list[int]:
    """The training steps in metrics.csv, in order (validation rows, which have no loss, left out)."""
    with (out_dir / "metrics.csv").open(newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row["loss"]]


def leftovers(out_dir: Path) -> list[str]:
    """Hidden files an interrupted run can leave behind: partial checkpoints, half-deleted ones, the lock."""
    return sorted(p.name for p in out_dir.iterdir() if p.name.startswith("."))
