"""How long `litsft` takes to answer commands that train nothing, and which heavy packages they import.

python benchmarks/bench_startup.py [--runs 5]

Each command runs in a fresh process, in an empty directory, the way a user types it (`python -m litsft
...`); the wall time is the median of --runs runs, taken in turns (command 1, 2, ..., then again) so that
load from other users hits all of them alike. One more run of each under `python -X importtime` lists
which of torch, lightning and jsonargparse it imported and their cumulative import time (importtime's own
bookkeeping makes that run slower; its figures are for comparing packages, not for wall time).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "lightning", "jsonargparse")
COMMANDS: list[tuple[str, list[str]]] = [
    ('python -c "import torch" (for reference)', ["-c", "import torch"]),
    ("litsft --help", ["-m", "litsft", "--help"]),
    ("litsft --version", ["-m", "litsft", "--version"]),
    ("litsft finetune_full --help", ["-m", "litsft", "finetune_full", "--help"]),
    ("litsft finetune_lora --data.help JSON", ["-m", "litsft", "finetune_lora", "--data.help", "JSON"]),
    (
        "litsft finetune_full ckpt --data Demo --print_config",
        ["-m", "litsft", "finetune_full", "ckpt", "--data", "Demo", "--print_config"],
    ),
    (
        "litsft finetune_full missing/checkpoint --data Demo (refused)",
        ["-m", "litsft", "finetune_full", "missing/checkpoint", "--data", "Demo"],
    ),
    (
        "litsft finetune_full ckpt --data Demo --train.micro_batch_size 0 (refused)",
        ["-m", "litsft", "finetune_full", "ckpt", "--data", "Demo", "--train.micro_batch_size", "0"],
    ),
]
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)")


def heavy_imports(argv: list[str], cwd: Path) -> dict[str, float]:
    """Seconds of cumulative import time of each top-level heavy package the command imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], cwd=cwd, capture_output=True, text=True, env=_env()
    )
    seconds = {}
    for match in IMPORT_LINE.finditer(result.stderr):
        cumulative, indent, module = match.groups()
        if module in HEAVY:
            seconds[module] = max(seconds.get(module, 0.0), int(cumulative) / 1e6)
    return seconds


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


def wall_time(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, env=_env())
    return time.perf_counter() - start


def main(runs: int) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} cores, load average {load} at the start, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as directory:
        cwd = Path(directory)
        times: dict[str, list[float]] = {name: [] for name, _ in COMMANDS}
        for _ in range(runs):
            for name, argv in COMMANDS:
                times[name].append(wall_time(argv, cwd))
        imports = {name: heavy_imports(argv, cwd) for name, argv in COMMANDS}
        leftovers = sorted(p.name for p in cwd.iterdir())
    print(f"median of {runs} runs; imports from one run under -X importtime (cumulative s)\n")
    print(f"| command | median s | runs s | {' | '.join(HEAVY)} |")
    print(f"|---|---:|---|{'---|' * len(HEAVY)}")
    for name, _ in COMMANDS:
        runs_s = " ".join(f"{t:.2f}" for t in times[name])
        found = " | ".join(f"{imports[name][m]:.2f}" if m in imports[name] else "-" for m in HEAVY)
        print(f"| {name} | {statistics.median(times[name]):.2f} | {runs_s} | {found} |")
    if leftovers:
        print(f"\nleft in the working directory: {leftovers}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    main(parser.parse_args().runs)
