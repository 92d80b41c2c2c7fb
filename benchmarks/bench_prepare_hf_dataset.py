"""Preparing a million short ShareGPT rows from a parquet file with `--data HFDataset`: wall time and peak
memory of what rank 0 does before training (`datasets` converts the parquet into its arrow cache, then the
rows are converted, rendered with the chat template, tokenized and masked a chunk at a time, and cached).

python benchmarks/bench_prepare_hf_dataset.py [--num_rows 1000000] [--out benchmarks/results/prepare_hf_dataset_cpu.txt]

The preparation runs in a fresh process (as `prepare()` runs on rank 0), so its peak resident memory is its
own; forked tokenizing workers are reported separately (their largest, not their sum).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu red green blue cat dog".split()


def write_rows(path: Path, num_rows: int) -> None:
    """Infinity-Instruct-shaped rows, short: one human question of 3-8 words and a 2-6 word answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    batch = 100_000
    writer = None
    for start in range(0, num_rows, batch):
        rows = [
            {
                "id": str(index),
                "conversations": [
                    {"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, 8))) + "?"},
                    {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))) + "."},
                ],
                "source": "bench",
            }
            for index in range(start, min(start + batch, num_rows))
        ]
        table = pa.Table.from_pylist(rows)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


def prepare(parquet: str, tokenizer_dir: str, cache_dir: str) -> None:
    """The child process: what rank 0 does, timed; prints one JSON line."""
    from litsft.data import HFDataset
    from litsft.data.tokenizer import Tokenizer

    start = time.perf_counter()
    data = HFDataset(path=parquet, cache_dir=Path(cache_dir), val_split_fraction=0.0)
    data.connect(Tokenizer(tokenizer_dir), max_seq_length=256, seed=0)
    data.prepare()
    seconds = time.perf_counter() - start
    samples, _ = data._load(warn=False)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "samples": len(samples),
                "tokens": int(len(samples.tokens)),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            }
        )
    )


def main(num_rows: int, out: Path | None) -> None:
    from litsft.data.demo import build_demo_tokenizer

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        start = time.perf_counter()
        write_rows(root / "rows.parquet", num_rows)
        written = time.perf_counter() - start
        build_demo_tokenizer(root / "tokenizer")
        env = {**os.environ, "HF_HOME": str(root / "hf-home"), "HF_HUB_OFFLINE": "1"}
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_prepare_hf_dataset as b; b.prepare(*sys.argv[1:])"
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                str(root / "rows.parquet"),
                str(root / "tokenizer"),
                str(root / "cache"),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        measured = json.loads(result.stdout.strip().splitlines()[-1])
        parquet_mb = (root / "rows.parquet").stat().st_size / 1e6
    lines = [
        f"rows: {num_rows:,} short ShareGPT conversations (one question of 3-8 words, one answer of 2-6), "
        f"parquet {parquet_mb:.1f} MB (written in {written:.1f} s, not counted)",
        f"prepared: {measured['samples']:,} samples, {measured['tokens']:,} tokens, demo tokenizer (ChatML), "
        "max_seq_length 256",
        f"wall time: {measured['seconds']:.1f} s ({num_rows / measured['seconds']:,.0f} rows/s), "
        "parquet -> datasets arrow cache -> conversations -> tokens -> litsft cache",
        f"peak resident memory: {measured['peak_rss_mb']:,.0f} MB in the preparing process, "
        f"{measured['worker_peak_rss_mb']:,.0f} MB in its largest tokenizing worker",
        f"machine: {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average before: {load_before:.1f}, "
        f"{time.strftime('%Y-%m-%d')}",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_rows", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    main(arguments.num_rows, arguments.out)
