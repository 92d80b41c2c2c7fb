"""litsft/training/profiling.py: the chosen steps profiled and no other, the trace a valid Chrome trace naming the
step's operators inside its `litsft step N` range, written also when the step fails; a real run with
`--log.profile_steps` writing them and training exactly as without, and on two processes one per rank; the CUDA
memory snapshot where there is a GPU."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from crash_harness import train_args
from launch import litsft, litsft_in_process, max_difference, write_records, write_tiny_checkpoint

from litsft.training.profiling import PROFILE_DIR, StepProfiler, memory_snapshot_path, trace_path

torch.set_num_threads(1)


def trace_events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def events_inside(events: list[dict], name: str) -> set[str]:
    """Names of the complete events that run inside the first event called `name` (by time, same thread)."""
    (outer,) = [e for e in events if e.get("name") == name and e.get("ph") == "X"]
    start, end = outer["ts"], outer["ts"] + outer["dur"]
    return {
        e["name"]
        for e in events
        if e.get("ph") == "X"
        and e.get("tid") == outer["tid"]
        and start <= e["ts"]
        and e["ts"] + e["dur"] <= end
    }


def matmul_step(device: str = "cpu") -> None:
    weight = torch.randn(64, 64, device=device, requires_grad=True)
    (torch.randn(8, 64, device=device) @ weight).square().sum().backward()


def test_only_the_chosen_steps_are_profiled_each_into_its_own_trace(tmp_path: Path) -> None:
    reports: list[str] = []
    profiler = StepProfiler(
        frozenset({2}), tmp_path / "profile", rank=1, device=torch.device("cpu"), report=reports.append
    )
    for step in (1, 2, 3):
        with profiler.step(step):
            matmul_step()
    trace = trace_path(tmp_path / "profile", 2, 1)
    assert (
        sorted(p.name for p in (tmp_path / "profile").iterdir())
        == [trace.name]
        == ["step-00000002-rank-1.json"]
    )
    inside = events_inside(trace_events(trace), "litsft step 2")
    assert {
        "aten::mm",
        "aten::sum",
    } <= inside and "autograd::engine::evaluate_function: MmBackward0" in inside
    assert reports == [f"Profiled step 2: {trace}"]
    profiler.report_unprofiled(first_step=1, last_step=3)
    assert reports[1:] == []


def test_a_failing_step_is_still_written_and_its_error_raised(tmp_path: Path) -> None:
    profiler = StepProfiler(
        frozenset({1}), tmp_path, rank=0, device=torch.device("cpu"), report=lambda _: None
    )
    with pytest.raises(RuntimeError, match="out of memory"), profiler.step(1):
        matmul_step()
        raise RuntimeError("out of memory")
    assert "aten::mm" in events_inside(trace_events(trace_path(tmp_path, 1, 0)), "litsft step 1")


def test_steps_the_run_never_reaches_are_named() -> None:
    reports: list[str] = []
    profiler = StepProfiler(
        frozenset({2, 185}), Path("unused"), 0, torch.device("cpu"), report=reports.append
    )
    profiler.report_unprofiled(first_step=3, last_step=10)
    assert reports == ["--log.profile_steps: step(s) 2, 185 not profiled: this run ran steps 3 to 10"]


def test_a_run_writes_the_traces_of_the_steps_named_and_trains_as_without(tmp_path: Path, capsys) -> None:
    """A one-process run of 4 steps with `--log.profile_steps 2:3`: traces of steps 2 and 3 only, each a Chrome
    trace whose step range holds the forward's matmuls, the backward and AdamW's step; the trained weights are
    those of the same run unprofiled, bit for bit."""
    base, data = write_tiny_checkpoint(tmp_path / "base"), write_records(tmp_path / "data.json")

    def run(name: str, *extra: str) -> str:
        args = train_args(base, data, tmp_path / name, "--devices", "1", "--train.max_steps", "4", *extra)
        return litsft_in_process(args, tmp_path, capsys).stdout

    out = run("profiled", "--log.profile_steps", "2:3")
    profile_dir = tmp_path / "profiled" / PROFILE_DIR
    assert sorted(p.name for p in profile_dir.iterdir()) == [
        "step-00000002-rank-0.json",
        "step-00000003-rank-0.json",
    ]
    for step in (2, 3):
        assert f"Profiled step {step}: {trace_path(profile_dir, step, 0)}\n" in out
        inside = events_inside(trace_events(trace_path(profile_dir, step, 0)), f"litsft step {step}")
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= inside, sorted(inside)[:40]
        assert any(name.startswith("autograd::engine::evaluate_function") for name in inside)
    assert "not profiled" not in out

    run("plain")
    assert max_difference(tmp_path / "profiled" / "final", tmp_path / "plain" / "final") == 0.0


def test_on_two_processes_each_rank_writes_its_trace_with_fsdps_collectives(tmp_path: Path) -> None:
    """FULL_SHARD over gloo: rank 0 and rank 1 each write step 2's trace, and each step range holds FSDP's
    all-gather of every block and its reduce-scatter after the backward."""
    base, data = write_tiny_checkpoint(tmp_path / "base"), write_records(tmp_path / "data.json")
    litsft(
        train_args(base, data, tmp_path / "out", "--train.max_steps", "2", "--log.profile_steps", "2"),
        tmp_path,
    )
    profile_dir = tmp_path / "out" / PROFILE_DIR
    assert sorted(p.name for p in profile_dir.iterdir()) == [
        "step-00000002-rank-0.json",
        "step-00000002-rank-1.json",
    ]
    for rank in (0, 1):
        inside = events_inside(trace_events(trace_path(profile_dir, 2, rank)), "litsft step 2")
        assert {
            "FSDP::all_gather (blocks.0)",
            "FSDP::all_gather (blocks.1)",
            "FSDP::post_backward_reduce",
        } <= inside


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the memory snapshot is CUDA's: this machine has no GPU"
)
def test_on_cuda_a_step_also_writes_its_memory_snapshot(tmp_path: Path) -> None:
    profiler = StepProfiler(
        frozenset({1}), tmp_path, rank=0, device=torch.device("cuda"), report=lambda _: None
    )
    with profiler.step(1):
        matmul_step("cuda")
    events = trace_events(trace_path(tmp_path, 1, 0))
    assert any(e.get("cat") == "kernel" for e in events), "the trace holds the step's CUDA kernels"
    # The snapshot this test just wrote, in torch's own pickle format (what pytorch.org/memory_viz reads).
    snapshot = pickle.loads(memory_snapshot_path(tmp_path, 1, 0).read_bytes())
    actions = {entry["action"] for trace in snapshot["device_traces"] for entry in trace}
    assert "alloc" in actions, sorted(actions)
