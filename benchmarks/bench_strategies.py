"""Memory and throughput of each sharding strategy on the demo model at 1, 2 and 4 ranks, on this machine's CPU.

python benchmarks/bench_strategies.py [--steps 8] [--ranks 1 2 4]
python benchmarks/bench_strategies.py --planner_only    # after a change to litsft/training/plan.py (seconds)

Each cell is a short `litsft finetune_full` run of demo-llama on `--data Demo` (micro batch 4 x 256 tokens
per rank, so the global batch grows with the ranks), launched by torchrun as on a cluster; HYBRID_SHARD runs
as two torchrun "nodes" on 127.0.0.1. Measured per cell:
- peak memory: the largest, over ranks, peak resident memory (getrusage) minus what the same process held
  after importing torch, Lightning and litsft: the memory training itself added;
- throughput: median tokens/s over all ranks of the steps after the first two (metrics.csv).
`--fsdp.cpu_offload` needs GPUs (litsft/training/parallel.py refuses it on CPU), so those cells say so.
The planner's per-GPU estimate for Llama 2 7B and 70B on 8 GPUs is printed next to it.

Writes benchmarks/results/bench_strategies.json and rewrites the tables in tutorials/sharding_strategies.md
between its `<!-- bench_strategies:... -->` markers (tests/test_docs.py checks that they agree).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_strategies.json"
TUTORIAL = ROOT / "tutorials" / "sharding_strategies.md"
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
NEEDS_GPU = "needs GPU"
PLANNED_MODELS = ("Llama-2-7b-hf", "Llama-2-70b-hf")


# ---- one training process (under torchrun) ----------------------------------------------------------------
def current_rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(result_dir: Path, litsft_args: list[str]) -> None:
    """Run `litsft ...` in this process and write this rank's memory to result_dir/rank-<r>.json."""
    import lightning  # noqa: F401  (imported before the baseline is taken)
    import torch  # noqa: F401

    import litsft.training.engine  # noqa: F401
    from litsft.__main__ import main

    baseline = current_rss_bytes()
    main(litsft_args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    rank = os.environ.get("RANK", "0")
    (result_dir / f"rank-{rank}.json").write_text(json.dumps({"baseline": baseline, "peak": peak}))


# ---- the sweep ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training_args(
    base: Path, out_dir: Path, strategy: str, ranks: int, checkpointing: bool, steps: int
) -> list[str]:
    nodes = 2 if strategy == "HYBRID_SHARD" and ranks > 1 else 1
    return [
        "finetune_full", str(base), "--out_dir", str(out_dir), "--resume", "false",
        "--data", "Demo", "--data.num_train", "2000", "--data.num_val", "16",
        "--devices", str(ranks // nodes), "--num_nodes", str(nodes),
        "--fsdp.sharding_strategy", strategy, "--fsdp.activation_checkpointing", str(checkpointing).lower(),
        "--precision", "32-true", "--train.max_steps", str(steps), "--train.max_seq_length", "256",
        "--train.micro_batch_size", "4", "--train.global_batch_size", str(4 * ranks),
        "--eval.max_batches", "1", "--eval.max_new_tokens", "0", "--optimizer.warmup_steps", "1",
    ]  # fmt: skip


def run_cell(
    work: Path, strategy: str, ranks: int, checkpointing: bool, steps: int, tag: str = ""
) -> dict[str, Any]:
    name = f"{tag}{strategy}-{ranks}-{'ac' if checkpointing else 'noac'}"
    out_dir, result_dir = work / "runs" / name, work / "memory" / name
    result_dir.mkdir(parents=True)
    args = training_args(work / "base", out_dir, strategy, ranks, checkpointing, steps)
    env = dict(os.environ, OMP_NUM_THREADS="1", LITSFT_CACHE_DIR=str(work / "cache"), PYTHONWARNINGS="ignore")
    me = [str(Path(__file__).resolve()), "--worker", str(result_dir), "--"]
    nodes = 2 if strategy == "HYBRID_SHARD" and ranks > 1 else 1
    if ranks == 1:
        commands = [[sys.executable, *me, *args]]
    else:
        port = free_port()
        commands = [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--node_rank",
                str(node),
                "--nproc_per_node",
                str(ranks // nodes),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                *me,
                *args,
            ]  # fmt: skip
            for node in range(nodes)
        ]
    started = time.perf_counter()
    processes = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    outputs = [p.communicate()[0] for p in processes]
    for process, output in zip(processes, outputs):
        if process.returncode != 0:
            raise RuntimeError(f"{name} exited {process.returncode}:\n{output[-4000:]}")
    with open(out_dir / "metrics.csv") as file:
        rows = [r for r in csv.DictReader(file) if r["tokens_per_second"]]
    throughput = statistics.median(float(r["tokens_per_second"]) for r in rows[2:] or rows)
    memory = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank-*.json"))]
    assert len(memory) == ranks, f"{name}: {len(memory)} of {ranks} ranks reported memory"
    peak_mib = max((m["peak"] - m["baseline"]) / 2**20 for m in memory)
    cell = {
        "strategy": strategy,
        "ranks": ranks,
        "activation_checkpointing": checkpointing,
        "cpu_offload": False,
    }
    cell |= {"peak_memory_mib": round(peak_mib, 1), "tokens_per_second": round(throughput)}
    print(f"{name}: {cell['peak_memory_mib']} MiB, {cell['tokens_per_second']} tokens/s "
          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return cell


def planner_rows() -> list[dict[str, Any]]:
    from litsft.model.config import Config
    from litsft.training.plan import estimate_memory, fits

    rows = []
    for model in PLANNED_MODELS:
        for strategy in STRATEGIES:
            for checkpointing in (False, True):
                estimate = estimate_memory(
                    Config.from_name(model), 8, 1, strategy, "bf16-mixed", 1, 2048, checkpointing
                )
                rows.append(
                    {
                        "model": model,
                        "strategy": strategy,
                        "activation_checkpointing": checkpointing,
                        "total_gib": round(estimate.total / 2**30, 2),
                        "fits_80gb": fits(estimate, 80 * 10**9),
                    }
                )
    return rows


# ---- tables -------------------------------------------------------------------------------------------------
def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def render_measured(results: dict[str, Any]) -> str:
    """The measured table: one row per strategy and options, memory and throughput per rank count."""
    ranks = results["ranks"]
    cells = {(c["strategy"], c["ranks"], c["activation_checkpointing"]): c for c in results["cells"]}
    header = "| strategy | activation checkpointing | CPU offload |"
    header += "".join(f" {n} rank{'s' * (n > 1)}: MiB | {n} rank{'s' * (n > 1)}: tokens/s |" for n in ranks)
    lines = [header, "|---|:---:|:---:|" + "---:|---:|" * len(ranks)]
    for offload in (False, True):
        for strategy in STRATEGIES:
            for checkpointing in (False, True) if not offload else (False,):
                row = f"| {strategy} | {yes_no(checkpointing)} | {yes_no(offload)} |"
                for n in ranks:
                    if offload:
                        row += f" {NEEDS_GPU} | {NEEDS_GPU} |"
                        continue
                    # One process runs without FSDP: the same run stands for every strategy.
                    cell = cells[("FULL_SHARD" if n == 1 else strategy, n, checkpointing)]
                    row += f" {cell['peak_memory_mib']:.1f} | {cell['tokens_per_second']:,} |"
                lines.append(row)
    return "\n".join(lines)


def render_planned(results: dict[str, Any]) -> str:
    lines = [
        "| model | strategy | activation checkpointing | GiB per GPU | fits 80GB |",
        "|---|---|:---:|---:|:---:|",
    ]
    for row in results["planner"]:
        lines.append(
            f"| {row['model']} | {row['strategy']} | {yes_no(row['activation_checkpointing'])} | "
            f"{row['total_gib']:.2f} | {yes_no(row['fits_80gb'])} |"
        )
    return "\n".join(lines)


def replace_between(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- bench_strategies:{name}:begin -->", f"<!-- bench_strategies:{name}:end -->"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def section(text: str, name: str) -> str:
    """The text between a table's markers, as `replace_between` writes it."""
    begin, end = f"<!-- bench_strategies:{name}:begin -->", f"<!-- bench_strategies:{name}:end -->"
    return text.split(begin)[1].split(end)[0].strip("\n")


def update_tutorial(results: dict[str, Any], tutorial: Path = TUTORIAL) -> None:
    text = tutorial.read_text()
    text = replace_between(text, "measured", render_measured(results))
    text = replace_between(text, "planned", render_planned(results))
    tutorial.write_text(text)


def update_planner() -> None:
    """After a change to litsft/training/plan.py: the planner's rows again, the measurements as they were."""
    results = json.loads(RESULTS.read_text())
    results["planner"] = planner_rows()
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    update_tutorial(results)
    print(render_planned(results))


def main(steps: int, ranks: list[int]) -> None:
    from litsft.cli.demo import make_base_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        make_base_checkpoint(work / "base", seed=0)
        # A first run tokenizes the data into the cache, so no measured run pays for (or holds) it.
        run_cell(work, "FULL_SHARD", 1, False, 1, tag="warmup-")
        cells = [run_cell(work, "FULL_SHARD", 1, c, steps) for c in (False, True) if 1 in ranks]
        for n in (n for n in ranks if n > 1):
            cells += [run_cell(work, s, n, c, steps) for s in STRATEGIES for c in (False, True)]
    results = {
        "command": f"python benchmarks/bench_strategies.py --steps {steps} --ranks {' '.join(map(str, ranks))}",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch CPU, gloo, OMP_NUM_THREADS=1",
        "model": "demo-llama, --data Demo, micro batch 4 x 256 tokens per rank, 32-true",
        "steps": steps,
        "ranks": ranks,
        "cells": cells,
        "planner": planner_rows(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    update_tutorial(results)
    print(render_measured(results))
    print(f"wrote {RESULTS} and the tables in {TUTORIAL}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[4:])
        raise SystemExit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--planner_only", action="store_true", help="keep the measured cells, recompute the planner's table"
    )
    arguments = parser.parse_args()
    if arguments.planner_only:
        update_planner()
    else:
        main(arguments.steps, arguments.ranks)
