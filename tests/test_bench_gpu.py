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

    from litsft.model.accounting.flops import executed_training_flops
    from litsft.model.config import Config
    from litsft.model.network.attention import cumulative_lengths

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
    from litsft.model.lora.layers import LoRAConfig
    from litsft.training.plan import estimate_memory

    assert bench_gpu.loss_difference(
        {10: 2.02, 20: 1.5, 30: 1.0}, {10: 2.0, 20: 1.5, 25: 9.0}
    ) == pytest.approx(0.01)
    config, args = Config.from_name("Llama-3.2-1B"), argparse.Namespace(max_seq_length=4096)
    lora = LoRAConfig(rank=16, alpha=32)
    full, adapters = bench_gpu.planned_peak_mib(config, args), bench_gpu.planned_peak_mib(config, args, lora)
    assert full == estimate_memory(config, max_seq_length=4096).total / 2**20
    assert adapters == estimate_memory(config, max_seq_length=4096, lora=lora).total / 2**20 < full


def test_bench_gpu_records_every_run_its_ratios_and_targets_in_its_results_file(
    tmp_path, monkeypatch
) -> None:
    """main() on a CPU with the GPU runs stood in for (each returns figures): the order of the runs, the
    figures and ratios written to --results_json, and that the file is rewritten after each run."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import argparse
    import json

    import bench_gpu
    import harness

    from litsft.model.config import Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(bench_gpu, "device_peak_flops", lambda device, precision: 989e12)
    # The real checkpoint and loader, on a tiny shape with the benchmark's vocabulary rows.
    monkeypatch.setattr(bench_gpu, "SHAPE_FIELDS", ("vocab_size",))
    from_name = Config.from_name
    monkeypatch.setattr(Config, "from_name", lambda name, **shape: from_name("demo-llama", **shape))
    monkeypatch.setattr(
        bench_gpu, "make_checkpoint", lambda directory, **shape: harness.make_checkpoint(directory)
    )
    results_json = tmp_path / "results.json"
    calls = []

    def fake_litsft_run(recipe, checkpoint, data, args, work, *extra):
        calls.append((recipe, *extra))
        assert (
            json.loads(results_json.read_text())["runs"] if len(calls) > 1 else True
        )  # written after each run
        speed = {"finetune_full": 1000.0, "finetune_lora": 1500.0}[recipe] * (
            1.2 if extra[-1:] == ("tensorwise",) else 1
        )
        losses = {10: 2.0, 20: 1.5} if not extra or extra[-1] != "tensorwise" else {10: 2.01, 20: 1.5}
        return {"tokens_per_second": speed, "mfu": 0.3, "peak_mib": 3000.0 if recipe == "finetune_full" else 1000.0,
                "losses": losses}  # fmt: skip

    monkeypatch.setattr(bench_gpu, "litsft_run", fake_litsft_run)
    monkeypatch.setattr(
        bench_gpu,
        "transformers_run",
        lambda *a: {"tokens_per_second": 800.0, "mfu": 0.25, "peak_mib": 3500.0},
    )
    args = argparse.Namespace(
        steps=3, warmup=1, max_seq_length=128, lora_rank=4, records=200, float8="tensorwise",
        results_json=str(results_json), work_dir=str(tmp_path / "work"), context_sizes=None, moe_layers=0,
    )  # fmt: skip
    bench_gpu.main(args)
    assert calls == [
        ("finetune_full",),
        ("finetune_lora", "--lora.rank", "4", "--lora.alpha", "8"),
        ("finetune_full", "--train.float8", "tensorwise"),
    ]
    results = json.loads(results_json.read_text())
    assert list(results["runs"]) == [
        "finetune_full",
        "transformers_loop",
        "finetune_lora_r4",
        "finetune_full_float8_tensorwise",
    ]
    assert results["device"] == "NVIDIA H100 80GB HBM3" and results["bf16_peak_flops"] == 989e12
    assert results["full_over_transformers_loop"] == 1000 / 800 and results["lora_over_full"] == 1.5
    assert results["float8_over_full"] == pytest.approx(1.2)
    assert results["float8_loss_max_relative_difference"] == pytest.approx(0.005)
    assert results["full_minus_lora_peak_mib"] == 2000.0
    full = results["runs"]["finetune_full"]
    assert full["plan_over_measured"] == full["planned_peak_mib"] / 3000.0


@pytest.mark.parametrize("gpus", [1, 2])
def test_bench_gpu_context_sizes_runs_each_size_on_two_gpus_and_skips_what_one_cannot_hold(
    gpus, tmp_path, monkeypatch
) -> None:
    """--context_sizes 1 2 on a CPU with the runs stood in for: finetune_full once per context size with
    activation checkpointing on two GPUs (one when that is all, context 2 then skipped with its reason), one
    row per data replica, tokens/s per GPU and MFU the medians of the rows after the first, the plan beside
    the peak, the torchtitan anchor in the results file."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import argparse
    import json

    import bench_gpu
    import harness

    from litsft.model.config import Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(bench_gpu, "SHAPE_FIELDS", ("vocab_size",))
    from_name = Config.from_name
    monkeypatch.setattr(Config, "from_name", lambda name, **shape: from_name("demo-llama", **shape))
    monkeypatch.setattr(
        bench_gpu, "make_checkpoint", lambda directory, **shape: harness.make_checkpoint(directory)
    )
    calls = []

    def fake_litsft_rows(recipe, checkpoint, data, args, *extra, devices=1, context=1):
        calls.append((recipe, *extra, devices, context))
        rate = 1000.0 / context
        return [
            {"tokens_per_second_per_device": 1.0, "mfu": 0.01, "peak_gpu_memory_allocated_mib": 500.0},
            {"tokens_per_second_per_device": rate, "mfu": 0.4, "peak_gpu_memory_allocated_mib": 300.0},
            {"tokens_per_second_per_device": rate + 10, "mfu": 0.42, "peak_gpu_memory_allocated_mib": 310.0},
            {"tokens_per_second_per_device": rate + 20, "mfu": 0.44, "peak_gpu_memory_allocated_mib": 320.0},
        ]

    monkeypatch.setattr(bench_gpu, "litsft_rows", fake_litsft_rows)
    results_json = tmp_path / "context.json"
    args = argparse.Namespace(
        steps=10, warmup=3, max_seq_length=256, lora_rank=4, records=50, float8="none",
        results_json=str(results_json), work_dir=str(tmp_path / "work"), context_sizes=[1, 2], moe_layers=0,
    )  # fmt: skip
    bench_gpu.main(args)
    options = ("--fsdp.activation_checkpointing", "true")
    expected = [("finetune_full", "--parallel.context", "1", *options, gpus, 1)]
    if gpus == 2:
        expected.append(("finetune_full", "--parallel.context", "2", *options, 2, 2))
    assert calls == expected
    results = json.loads(results_json.read_text())
    assert results["device"] == "NVIDIA H200" and results["gpus_used"] == gpus
    assert results["anchor"]["tokens_per_second_per_gpu"]["131072 tokens, CP 4"] == 1071
    one = results["runs"]["context_1"]
    assert (one["tokens_per_second_per_gpu"], one["mfu"], one["peak_mib"]) == (1010.0, 0.42, 500.0)
    assert one["planned_peak_mib"] > 0
    if gpus == 1:
        assert results["skipped"] == {"context_2": "--parallel.context 2 needs 2 GPUs of one node; found 1"}
    else:
        assert results["runs"]["context_2"]["tokens_per_second_per_gpu"] == 510.0 and results["skipped"] == {}


def test_bench_gpu_moe_layers_runs_finetune_full_and_the_transformers_loop_on_the_cut_down_moe(
    tmp_path, monkeypatch
) -> None:
    """--moe_layers 2 on a CPU with the GPU runs stood in for: the checkpoint gets Qwen3-30B-A3B's expert fields
    and 2 layers, finetune_full then the transformers loop run, and the results file (written after the first
    run already) holds both with their ratio and the plan."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import argparse
    import json

    import bench_gpu
    import harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    shapes = []

    def tiny_checkpoint(directory, **shape):
        shapes.append(shape)
        return harness.make_checkpoint(directory)  # the demo model: the real loader on tiny rows

    monkeypatch.setattr(bench_gpu, "make_checkpoint", tiny_checkpoint)
    results_json = tmp_path / "moe.json"
    runs = []

    def fake_litsft_run(recipe, checkpoint, data, args, work, *extra):
        runs.append(recipe)
        return {"tokens_per_second": 900.0, "mfu": 0.2, "peak_mib": 3000.0, "losses": {}}

    def fake_transformers_run(config, batches, args, work):
        runs.append("transformers")
        assert list(json.loads(results_json.read_text())["runs"]) == ["finetune_full"]  # already written
        return {"tokens_per_second": 600.0, "mfu": 0.1, "peak_mib": 4000.0}

    monkeypatch.setattr(bench_gpu, "litsft_run", fake_litsft_run)
    monkeypatch.setattr(bench_gpu, "transformers_run", fake_transformers_run)
    args = argparse.Namespace(
        steps=3, warmup=1, max_seq_length=128, lora_rank=4, records=200, float8="none",
        results_json=str(results_json), work_dir=str(tmp_path / "work"), context_sizes=None, moe_layers=2,
    )  # fmt: skip
    bench_gpu.main(args)
    assert runs == ["finetune_full", "transformers"]
    assert (
        shapes[0]["num_layers"] == 2
        and shapes[0]["num_experts"] == 128
        and shapes[0]["experts_per_token"] == 8
    )
    assert shapes[0]["hf_architecture"] == "Qwen3MoeForCausalLM" and shapes[0]["vocab_size"] == 151936
    results = json.loads(results_json.read_text())
    assert results["model"] == "Qwen3-30B-A3B's layers, 2 of 48" and results["device"] == "NVIDIA H200"
    assert list(results["runs"]) == ["finetune_full", "transformers_loop"]
    assert (
        results["full_over_transformers_loop"] == 1.5
        and results["runs"]["finetune_full"]["planned_peak_mib"] > 0
    )
