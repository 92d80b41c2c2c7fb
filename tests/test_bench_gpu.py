"""benchmarks/bench_gpu.py on a machine without a GPU: it parses its arguments and stops with one line."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_bench_gpu(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int | str | None:
    """`python bench_gpu.py <argv>` in this process; the SystemExit's code (a message is what the interpreter
    prints to stderr before it exits with status 1)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / "benchmarks" / "bench_gpu.py"), run_name="__main__")
    return stop.value.code


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_bench_gpu_without_a_gpu_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    code = run_bench_gpu(["--steps", "3", "--work_dir", str(tmp_path)], monkeypatch)
    assert (
        code
        == "error: bench_gpu.py needs a CUDA GPU and found none; on a CPU run benchmarks/bench_throughput.py"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert run_bench_gpu(["--steps", "many"], monkeypatch) == 2
    assert "--steps: invalid int value: 'many'" in capsys.readouterr().err


def test_bench_gpu_counts_what_each_side_executes_and_times_after_the_warm_up(monkeypatch) -> None:
    """The work of a step: litsft's non-padding tokens, its documents' attention and its head on the loss
    tokens; the plain loop causal over the whole row with the head everywhere. Rates come from litsft's rows
    after the first (the warm-up), each row's rate weighted by the tokens of the steps it covers."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_gpu
    from bench_gpu import StepWork

    from litsft.model.attention import cumulative_lengths
    from litsft.model.config import Config
    from litsft.model.flops import executed_training_flops

    config = Config.from_name("tiny-llama")
    labels = torch.full((1, 16), -100)
    labels[0, 2:9] = 1
    batch = {
        "input_ids": torch.ones(1, 16, dtype=torch.long),
        "labels": labels,
        "document_ids": torch.tensor([[0] * 5 + [1] + [2] * 6 + [-1] * 4]),
        "cu_seqlens": cumulative_lengths([5, 1, 6]),
    }
    assert bench_gpu.step_work(config, [batch], "litsft") == [
        StepWork(12, executed_training_flops(config, [5, 1, 6], head_tokens=7))
    ]
    assert bench_gpu.step_work(config, [batch], "plain") == [
        StepWork(12, executed_training_flops(config, [16], head_tokens=16))
    ]
    work = [
        StepWork(100, 1e6),
        StepWork(100, 1e6),
        StepWork(100, 2e6),
        StepWork(100, 2e6),
        StepWork(100, 4e6),
    ]
    rows = [{"step": 2, "tokens_per_second": 1.0}, {"step": 4, "tokens_per_second": 50.0}]
    rows.append({"step": 5, "tokens_per_second": 25.0})
    # Steps 3-4: 200 tokens at 50/s, 4 s; step 5: 100 tokens at 25/s, 4 s.
    assert bench_gpu.measured_rates(rows, work, peak_flops=1e6) == {
        "tokens_per_second": 37.5,
        "mfu": 8e6 / 8 / 1e6,
    }


def test_bench_gpu_compares_float8_losses_and_asks_the_planner_for_each_run(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import argparse

    import bench_gpu

    from litsft.model.config import Config
    from litsft.model.lora import LoRAConfig
    from litsft.training.plan import estimate_memory

    assert bench_gpu.loss_difference(
        {10: 2.02, 20: 1.5, 30: 1.0}, {10: 2.0, 20: 1.5, 25: 9.0}
    ) == pytest.approx(0.01)
    config, args = Config.from_name("Llama-3.2-1B"), argparse.Namespace(max_seq_length=4096)
    lora = LoRAConfig(rank=16, alpha=32)
    full, adapters = bench_gpu.planned_peak_mib(config, args), bench_gpu.planned_peak_mib(config, args, lora)
    assert full == estimate_memory(config, max_seq_length=4096).total / 2**20
    assert adapters == estimate_memory(config, max_seq_length=4096, lora=lora).total / 2**20 < full
