"""What the benchmarks share: a tiny checkpoint, instruction data of mixed lengths, running litsft in a
fresh process the way a user does, reading its metrics.csv, and a description of the machine.

Not a benchmark itself; `python benchmarks/bench_*.py` imports it (benchmarks/ is on sys.path then).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from litsft.checkpoint.model_folder import save_model_folder
from litsft.data.demo import WORDS, build_demo_tokenizer
from litsft.data.tokenizer import Tokenizer
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer

REPO = Path(__file__).resolve().parent.parent


def machine_description() -> str:
    """CPU model, cores, load, torch version: the line every result file starts with."""
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor() or "unknown CPU",
    )  # fmt: skip
    flags = Path("/proc/cpuinfo").read_text()
    extras = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16") if f" {flag}" in flags]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpu} ({' '.join(extras) or 'no avx512'}), {os.cpu_count()} cores, load average {load}, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def make_checkpoint(directory: Path, seed: int = 0, **shape: object) -> Path:
    """A randomly initialized demo-llama (or `shape` overrides) with the demo tokenizer, as a litsft checkpoint.
    The vocabulary is the tokenizer's unless `shape` gives a larger one (its extra rows are never looked up)."""
    build_demo_tokenizer(directory)
    shape.setdefault("vocab_size", Tokenizer(directory).vocab_size)
    config = Config.from_name("demo-llama", **shape)
    model = Transformer(config)
    model.init_weights(seed)
    save_model_folder(model.state_dict().items(), config, directory, directory)
    return directory


def write_mixed_length_data(path: Path, count: int, max_words: int, seed: int = 0) -> Path:
    """Instruction records whose outputs run from a few words to `max_words` (log-uniform): the mix of
    lengths that makes padding expensive and packing worth it. Demo words are one token each."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        words = int(round(2 ** rng.uniform(1, max(1.0, (max_words).bit_length() - 1))))
        text = " ".join(rng.choice(WORDS) for _ in range(min(words, max_words)))
        records.append({"instruction": f"Repeat the words: {text[:40]}", "output": text})
    path.write_text(json.dumps(records))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_env(work_dir: Path, threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        LITSFT_CACHE_DIR=str(work_dir / "cache"),
        TMPDIR=str(work_dir),
        TORCHINDUCTOR_CACHE_DIR=str(work_dir / "inductor"),
        MASTER_PORT=str(free_port()),
        PYTHONWARNINGS="ignore",
    )
    env.update(extra or {})
    return env


def run_litsft(
    args: list[str],
    work_dir: Path,
    threads: int,
    extra_env: dict[str, str] | None = None,
    python: str | Path = sys.executable,
    capture: bool = True,
) -> tuple[float, str]:
    """Run `python -m litsft ...` (with this interpreter by default); returns its wall time and its stdout.
    Raises with the output's tail if it fails. `capture=False` lets its output through to this process's, as
    it comes (a run killed at a time limit then leaves its progress in the log), and returns "" for it."""
    started = time.perf_counter()
    result = subprocess.run(
        [str(python), "-m", "litsft", *args],
        env=bench_env(work_dir, threads, extra_env),
        capture_output=capture,
        text=True,
        cwd=work_dir,
    )
    if result.returncode != 0:
        tail = result.stderr[-4000:] if capture else "(its output is above)"
        raise RuntimeError(f"litsft {' '.join(args)} exited {result.returncode}:\n{tail}")
    return time.perf_counter() - started, result.stdout or ""


def training_rows(out_dir: Path) -> list[dict[str, float]]:
    """The training rows of a run's metrics.csv (validation rows left out), as floats."""
    with open(out_dir / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["loss"]]
    return [{k: float(v) for k, v in row.items() if v != ""} for row in rows]


def median(values: list[float]) -> float:
    return statistics.median(values)
