"""How long `litsft` takes to answer commands that train nothing, and which heavy packages they import.

python benchmarks/bench_startup.py [--runs 5] [--baseline DIR]

Each command runs in a fresh process, in an empty directory, the way a user types it (`python -m litsft
...`); the wall time is the median of --runs runs, taken in turns (command 1, 2, ..., then again) so that
load from other users hits all of them alike. One more run of each under `python -X importtime` lists
which of torch, lightning and jsonargparse it imported and their cumulative import time (importtime's own
bookkeeping makes that run slower; its figures are for comparing packages, not for wall time).

The directory holds a tiny checkpoint (`ckpt`), instruction data (`data.json`) and a finished run
(`finished/final`), so the last refusal passes every check but out_dir's: the model, its tokenizer and the
data are read first.
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
        "litsft finetune_full no/such/checkpoint --data Demo (refused)",
        ["-m", "litsft", "finetune_full", "no/such/checkpoint", "--data", "Demo"],
    ),
    (
        "litsft finetune_full ckpt --data Demo --train.micro_batch_size 0 (refused)",
        ["-m", "litsft", "finetune_full", "ckpt", "--data", "Demo", "--train.micro_batch_size", "0"],
    ),
    (
        "litsft finetune_full ckpt --data JSON --data.json_path data.json --out_dir finished (refused)",
        [
            "-m",
            "litsft",
            "finetune_full",
            "ckpt",
            "--data",
            "JSON",
            "--data.json_path",
            "data.json",
            "--out_dir",
            "finished",
        ],
    ),  # fmt: skip
]
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)")


def heavy_imports(argv: list[str], cwd: Path, pythonpath: str | None) -> dict[str, float]:
    """Seconds of cumulative import time of each top-level heavy package the command imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=_env(pythonpath),
    )
    seconds = {}
    for match in IMPORT_LINE.finditer(result.stderr):
        cumulative, _, module = match.groups()
        if module in HEAVY:
            seconds[module] = max(seconds.get(module, 0.0), int(cumulative) / 1e6)
    return seconds


def _env(pythonpath: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def wall_time(argv: list[str], cwd: Path, pythonpath: str | None) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, env=_env(pythonpath))
    return time.perf_counter() - start


def main(runs: int, baseline: str | None) -> None:
    from harness import make_checkpoint, write_mixed_length_data

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} cores, load average {load} at the start, Python {platform.python_version()}")
    versions = {"this checkout": None, **({"baseline": baseline} if baseline else {})}
    with tempfile.TemporaryDirectory() as directory:
        cwd = Path(directory)
        make_checkpoint(cwd / "ckpt")
        write_mixed_length_data(cwd / "data.json", 32, max_words=40)
        (cwd / "finished" / "final").mkdir(parents=True)
        made = {p.name for p in cwd.iterdir()}
        times = {(version, name): [] for version in versions for name, _ in COMMANDS}
        for _ in range(runs):
            for name, argv in COMMANDS:
                for version, pythonpath in versions.items():  # in turns, so load hits both alike
                    times[version, name].append(wall_time(argv, cwd, pythonpath))
        imports = {
            (version, name): heavy_imports(argv, cwd, pythonpath)
            for version, pythonpath in versions.items()
            for name, argv in COMMANDS
        }
        leftovers = sorted(p.name for p in cwd.iterdir() if p.name not in made)
    print(f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"median of {runs} runs; imports from one run under -X importtime (cumulative s)")
    for version, pythonpath in versions.items():
        print(f"\n{version}{f' (PYTHONPATH={pythonpath})' if pythonpath else ''}:\n")
        print(f"| command | median s | runs s | {' | '.join(HEAVY)} |")
        print(f"|---|---:|---|{'---|' * len(HEAVY)}")
        for name, _ in COMMANDS:
            runs_s = " ".join(f"{t:.2f}" for t in times[version, name])
            found = imports[version, name]
            columns = " | ".join(f"{found[m]:.2f}" if m in found else "-" for m in HEAVY)
            print(f"| {name} | {statistics.median(times[version, name]):.2f} | {runs_s} | {columns} |")
    if leftovers:
        print(f"\nleft in the working directory: {leftovers}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--baseline",
        default=None,
        help="a directory holding another version's litsft/ (with litsft/recipes), put first on PYTHONPATH "
        "to time it in turns with this checkout",
    )
    args = parser.parse_args()
    main(args.runs, args.baseline)
