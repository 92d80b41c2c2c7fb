"""benchmarks/bench_gpu.py on a machine without a GPU: it parses its arguments and stops with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_bench_gpu_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "bench_gpu.py", "--steps", "3", "--work_dir", str(tmp_path)],
        cwd=REPO / "benchmarks", capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: bench_gpu.py needs a CUDA GPU and found none; on a CPU run benchmarks/bench_throughput.py"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing written
    bad = subprocess.run(
        [sys.executable, "bench_gpu.py", "--steps", "many"],
        cwd=REPO / "benchmarks",
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--steps: invalid int value: 'many'" in bad.stderr
