"""Profiling chosen optimizer steps (`--log.profile_steps`): a torch.profiler Chrome trace of each, and on CUDA a
memory snapshot, written by every rank into out_dir/profile/.

The trace (`step-00000003-rank-0.json`) holds the step's operators, CPU and (on CUDA) kernels, under one
`litsft step 3` range; open it in https://ui.perfetto.dev or chrome://tracing. The memory snapshot
(`step-00000003-rank-0-memory.pickle`, torch's own format, written by
`torch.cuda.memory._dump_snapshot`) records every allocation of the step with its stack; drop it on
https://pytorch.org/memory_viz. Recording starts when the step starts and ends when it ends, so the first
steps of a run (compilation, the allocator's warm-up) are profiled only when asked for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PROFILE_DIR = "profile"
MEMORY_HISTORY_ENTRIES = 100_000
"""Allocation events the CUDA memory history keeps, the newest (the value PyTorch's guide records with:
https://pytorch.org/docs/stable/torch_cuda_memory.html); older ones are dropped from the snapshot."""


def trace_path(profile_dir: Path, step: int, rank: int) -> Path:
    return profile_dir / f"step-{step:08d}-rank-{rank}.json"


def memory_snapshot_path(profile_dir: Path, step: int, rank: int) -> Path:
    return profile_dir / f"step-{step:08d}-rank-{rank}-memory.pickle"


class StepProfiler:
    """Profiles the steps it is given; every other step runs as if it were not there."""

    def __init__(
        self,
        steps: frozenset[int],
        profile_dir: Path,
        rank: int,
        device: torch.device,
        report: Callable[[str], None] = print,
    ) -> None:
        self.steps, self.profile_dir, self.rank, self.device = steps, profile_dir, rank, device
        self.report = report
        """Where the written files are named (the engine passes fabric.print: the first rank says it)."""
        self.profiled: set[int] = set()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run one optimizer step, profiled when it is one of `steps`."""
        if step not in self.steps:
            yield
            return
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        on_cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        if on_cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        profiler.start()
        try:
            with record_function(f"litsft step {step}"):
                yield
        finally:
            # Also when the step fails: an out-of-memory step is the one whose snapshot is wanted.
            profiler.stop()
            trace = trace_path(self.profile_dir, step, self.rank)
            profiler.export_chrome_trace(str(trace))
            written = [trace]
            if on_cuda:
                snapshot = memory_snapshot_path(self.profile_dir, step, self.rank)
                torch.cuda.memory._dump_snapshot(str(snapshot))
                torch.cuda.memory._record_memory_history(enabled=None)
                written.append(snapshot)
            self.profiled.add(step)
            self.report(f"Profiled step {step}: {', '.join(str(path) for path in written)}")

    def report_unprofiled(self, first_step: int, last_step: int) -> None:
        """Name the chosen steps this run did not run (past its end, or before the step it resumed from), so
        that asking for them is not mistaken for a profile that came out empty."""
        missed = sorted(self.steps - self.profiled)
        if missed:
            steps = ", ".join(map(str, missed[:5])) + (", ..." if len(missed) > 5 else "")
            self.report(
                f"--log.profile_steps: step(s) {steps} not profiled: this run ran steps {first_step} to "
                f"{last_step}"
            )
