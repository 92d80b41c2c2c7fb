"""Crash safety of a 2-process FULL_SHARD run: SIGKILL mid-checkpoint, SIGTERM, a full disk. After each, the
same command finishes with weights bit-identical to an uninterrupted run's. (The ten-moment crash run is
benchmarks/bench_fault_injection.py; these are three of its moments, chained.)"""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import launch
import pytest
import torch
from crash_harness import (
    DATA_MODULES,
    crash_and_recover,
    data_options,
    leftovers,
    logged_steps,
    run_litsft,
    train_args,
    write_data_inputs,
)
from launch import (
    DEADLINE_S,
    free_port,
    litsft_in_process,
    max_difference,
    write_records,
    write_tiny_checkpoint,
)
from tiny_datasets import registered_data_modules

from litsft.checkpoint.checkpoint_dirs import find_damage, read_trainer_state
from litsft.checkpoint.training_checkpoint import is_complete, latest_checkpoint, stored_tensors
from litsft.runtime.faults import FAULT_ENV
from litsft.runtime.preemption import PREEMPTED_EXIT_CODE


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    write_tiny_checkpoint(root / "base", seed=1)
    write_records(root / "data.json")
    run = run_litsft(train_args(root / "base", root / "data.json", root / "reference"), root)
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def args_for(workspace: Path, name: str, *extra: str) -> list[str]:
    return train_args(workspace / "base", workspace / "data.json", workspace / name, *extra)


def assert_same_as_reference(workspace: Path, name: str) -> None:
    out_dir = workspace / name
    assert max_difference(workspace / "reference" / "final", out_dir / "final") == 0.0
    assert logged_steps(out_dir) == list(range(1, 9)), "a step was lost or repeated"
    assert leftovers(out_dir) == []


def test_three_kills_mid_checkpoint_then_relaunch_equals_uninterrupted_run(workspace: Path) -> None:
    faults = ["save_2_shards_written@1", "save_4_before_rename", "final_before_rename"]
    runs = crash_and_recover(args_for(workspace, "killed"), workspace, faults)
    print(f"{len(faults)}/{len(faults)} kills recovered in {sum(r.seconds for r in runs):.0f} s")
    assert "Resumed from" in runs[-1].stdout + runs[-1].stderr
    assert_same_as_reference(workspace, "killed")
    # keep_last 2, applied only after each new checkpoint was complete.
    assert sorted(p.name for p in (workspace / "killed").glob("step-*")) == ["step-00000006", "step-00000008"]


def test_kills_during_background_saves_leave_the_previous_checkpoint_newest_and_lose_nothing(
    workspace: Path,
) -> None:
    """--train.async_save: killed while rank 1 writes step 4's files in the background (training has gone
    on), then just before step 6's rename: each time the previous checkpoint is the newest complete one, and
    the relaunches end exactly where the uninterrupted (synchronous) run did."""
    args = args_for(workspace, "killed-async", "--train.async_save", "true")
    out_dir = workspace / "killed-async"
    newest = []
    for fault in ("save_4_writing_in_background@1", "save_6_before_rename"):
        run = run_litsft(args, workspace, fault)
        assert run.returncode == -9, run.stderr[-3000:]
        newest.append(latest_checkpoint(out_dir).name)
    assert newest == ["step-00000002", "step-00000004"]
    run = run_litsft(args, workspace)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_as_reference(workspace, "killed-async")
    assert sorted(p.name for p in out_dir.glob("step-*")) == ["step-00000006", "step-00000008"]
    for checkpoint in out_dir.glob("step-*"):  # both ranks' checksums reached rank 0 from the writing thread
        state = read_trainer_state(checkpoint)
        assert (
            sorted(state["file_checksums"]) == state["files"] and "rank-00001.safetensors" in state["files"]
        )
        assert find_damage(checkpoint, contents=True) is None


@pytest.fixture(scope="module")
def data_inputs(workspace: Path) -> Path:
    root = workspace / "data-modules"
    with pytest.MonkeyPatch.context() as env:  # litdata's caches, as test_env places them for subprocesses
        for name, value in launch.test_env(root).items():
            if name.startswith("DATA_OPTIMIZER") or name == "TMPDIR":
                env.setenv(name, value)
        write_data_inputs(root, workspace / "base")
    return root


@pytest.mark.parametrize("module", registered_data_modules())
def test_every_data_module_resumes_mid_epoch_as_if_never_stopped(
    data_inputs: Path, module: str, capsys: pytest.CaptureFixture
) -> None:
    """One process, 4 steps, a checkpoint every 2; then the same command on a copy of its out_dir cut back to
    what a kill after step 3 leaves (step-2 the newest checkpoint, step 3 in metrics.csv): the relaunch checks
    that the checkpoint fits the data (before anything starts), resumes at step 2 mid-epoch, and ends where the
    uninterrupted run ends. The kills themselves are the 2-process tests above; these runs are in-process."""
    assert module in DATA_MODULES, (
        f"add --data {module}'s recipe and options to DATA_MODULES in crash_harness.py"
    )
    recipe, data = data_options(module, data_inputs)
    # One module trains its bf16 weights with compensated AdamW, whose compensation must resume too.
    precision = "bf16-true" if module == "Demo" else "32-true"

    def args(name: str) -> list[str]:
        return train_args(data_inputs.parent / "base", data, data_inputs / name, "--devices", "1",
                          "--train.max_steps", "4", "--precision", precision, recipe=recipe)  # fmt: skip

    reference, resumed = data_inputs / f"{module}-reference", data_inputs / f"{module}-resumed"
    litsft_in_process(args(reference.name), data_inputs, capsys)
    shutil.copytree(reference, resumed, ignore=shutil.ignore_patterns("final", "step-00000004"))
    rows = (resumed / "metrics.csv").read_text().splitlines(keepends=True)
    (resumed / "metrics.csv").write_text("".join(row for row in rows if not row.startswith("4,")))
    assert logged_steps(resumed) == [1, 2, 3], "the cut-back out_dir is not what a kill after step 3 leaves"
    result = litsft_in_process(args(resumed.name), data_inputs, capsys)
    assert "Resumed from" in result.stdout + result.stderr
    assert max_difference(reference / "final", resumed / "final") == 0.0
    assert logged_steps(resumed) == [1, 2, 3, 4], "a step was lost or repeated"


def start_paused_at_step_3(
    workspace: Path, name: str, marker: Path, action: str = "pause", more_faults: str = ""
) -> subprocess.Popen:
    """A run with no periodic checkpoint (the one a stop writes is the only one), rank 0 held after step 3
    until a signal reaches it (`pause`) or for ever (`hold`); in a session of its own, as a terminal's
    foreground job is. `more_faults`: further LITSFT_FAULT_AT entries."""
    env = dict(
        launch.test_env(workspace),
        MASTER_PORT=str(free_port()),
        **{FAULT_ENV: f"after_step_3:{action}={marker}{more_faults}"},
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "litsft", *args_for(workspace, name, "--train.save_interval", "100")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + DEADLINE_S
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), process.communicate()[0][-3000:]
    return process


class LineReader:
    """A process's output read by a thread as it comes, so that a test can wait for a line (the event it means)
    and still get the whole output at the end."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self.lines, self.closed = process, [], False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, line: str) -> bool:
        """Whether `line` was printed before the output ended or DEADLINE_S passed."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or any(line in seen for seen in self.lines), DEADLINE_S)
            return any(line in seen for seen in self.lines)

    def rest(self) -> str:
        """The whole output, once the process has ended."""
        self.process.wait(timeout=DEADLINE_S)
        self.thread.join(timeout=DEADLINE_S)
        return self.text()


@pytest.mark.parametrize(
    "name, send",
    [
        # `kill <pid>`: the signal reaches only Fabric's launcher (rank 0); rank 1 stops with it.
        ("sigterm", lambda process: os.kill(process.pid, signal.SIGTERM)),
        # Ctrl-C in a terminal: SIGINT to every process of the foreground job.
        ("ctrl-c", lambda process: os.killpg(process.pid, signal.SIGINT)),
    ],
)
def test_a_stop_signal_checkpoints_and_exits_124_then_resumes_without_losing_a_step(
    workspace: Path, name: str, send: Callable[[subprocess.Popen], None]
) -> None:
    out_dir, marker = workspace / name, workspace / f"{name}-reached-step-3"
    started = time.monotonic()
    process = start_paused_at_step_3(workspace, name, marker)
    signalled = time.monotonic()
    send(process)
    output = process.communicate(timeout=DEADLINE_S)[0]
    grace, reached = time.monotonic() - signalled, signalled - started
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    # Within a SLURM/torchrun grace period (30 s) on an idle machine; on a loaded one, within the time the run
    # took to start and train 3 steps, which slows down as much (one step and a checkpoint against all that).
    assert grace < max(30.0, reached), f"stopping took {grace:.1f} s, the run {reached:.1f} s to reach step 3"
    assert latest_checkpoint(out_dir) == out_dir / "step-00000003"
    assert "Stopped by a signal after step 3" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]

    rerun = run_litsft(args_for(workspace, name), workspace)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Resumed from" in rerun.stdout + rerun.stderr
    assert_same_as_reference(workspace, name)


def test_a_second_ctrl_c_stops_every_process_at_once_in_one_line(workspace: Path) -> None:
    """Two Ctrl-C while rank 0 hangs in a step that never ends and rank 1 waits for it in a collective (where
    Python's own signal handling cannot run): every process ends at once, no traceback, no checkpoint."""
    out_dir, marker = workspace / "ctrl-c-twice", workspace / "ctrl-c-twice-reached-step-3"
    process = start_paused_at_step_3(workspace, "ctrl-c-twice", marker, action="hold")
    output = LineReader(process)
    os.killpg(process.pid, signal.SIGINT)
    # The second Ctrl-C only once the first has been taken: sent after a fixed pause, on a loaded machine both
    # could be pending together, and a process then sees one Ctrl-C (which waits for the held step for ever).
    assert output.wait_for("Ctrl-C: stopping after this step"), output.text()[-3000:]
    signalled = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)
    output = output.rest()
    assert time.monotonic() - signalled < 10, output[-3000:]
    assert process.returncode == 130, output[-3000:]
    assert "Stopped at once by a second Ctrl-C" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert latest_checkpoint(out_dir) is None
    with pytest.raises(ProcessLookupError):  # no rank is left behind in the job's process group
        os.killpg(process.pid, 0)


def test_a_second_ctrl_c_once_the_checkpoint_is_written_loses_nothing_and_exits_124(workspace: Path) -> None:
    """The first Ctrl-C's checkpoint of step 3 is published, and rank 0 hangs on its way out: a second Ctrl-C
    ends every process at once with the requeue code, says no step is lost, and leaves the loss plot."""
    out_dir, paused, held = (
        workspace / "ctrl-c-late",
        workspace / "ctrl-c-late-at-3",
        workspace / "ctrl-c-late-held",
    )
    process = start_paused_at_step_3(
        workspace, "ctrl-c-late", paused, more_faults=f",stop_checkpoint_published:hold={held}"
    )
    os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + DEADLINE_S
    while not held.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held.exists(), process.communicate()[0][-3000:]
    signalled = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)
    output = process.communicate(timeout=DEADLINE_S)[0]
    assert time.monotonic() - signalled < 10, output[-3000:]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "Stopped at once by a second Ctrl-C after the checkpoint was written: no step is lost" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert latest_checkpoint(out_dir) == out_dir / "step-00000003"
    assert (out_dir / "loss.png").is_file()


RANK_1_SHARD = "shards/shard-00002-model-00001-of-00001.safetensors"
"""The file rank 1 writes its part of the tensors to (DCP numbers them from 1)."""


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_64_bytes_of_a_weight(path: Path) -> None:
    """Invert 64 bytes in the middle of the tensor data (after the 8-byte length and the JSON header)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = (start + len(data)) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def damage_the_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[12:20] = b"\xff" * 8  # inside the JSON header: no longer JSON
    path.write_bytes(bytes(data))


def plant_same_size_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


CHANGED = "does not hold the bytes it was written with (its checksum differs)"


@pytest.mark.parametrize(
    ("kind", "damage", "expected"),
    [
        ("truncated-shard", lambda c: truncate(c / RANK_1_SHARD),
         f"{RANK_1_SHARD} is truncated ({{half:,}} of {{size:,}} bytes)"),
        ("missing-rank-file", lambda c: (c / "rank-00001.safetensors").unlink(), "rank-00001.safetensors is missing"),
        ("extra-file", lambda c: shutil.copy(c / RANK_1_SHARD, c / "shards" / "shard-00003-model-00001-of-00001.safetensors"),
         "shards/shard-00003-model-00001-of-00001.safetensors is not a file it was written with"),
        ("flipped-weight", lambda c: flip_64_bytes_of_a_weight(c / RANK_1_SHARD), f"{RANK_1_SHARD} {CHANGED}"),
        ("damaged-header", lambda c: damage_the_header(c / RANK_1_SHARD), f"{RANK_1_SHARD} {CHANGED}"),
        ("planted-rank-file", lambda c: plant_same_size_bytes(c / "rank-00001.safetensors"),
         f"rank-00001.safetensors {CHANGED}"),
    ],
)  # fmt: skip
def test_a_damaged_newest_checkpoint_is_named_moved_aside_and_the_run_goes_on_from_the_one_before(
    workspace: Path, kind: str, damage: Callable[[Path], None], expected: str
) -> None:
    """The newest checkpoint (step 8 of 8) damaged after it was published: the relaunch says which checkpoint
    and how, moves it aside whole, resumes from step 6, saves step 8 again under its own name and finishes
    with the uninterrupted run's weights. One rule for every damage: a file cut short, missing or extra, and
    one whose bytes changed at its size (a weight's bytes flipped, which trained on silently; a header no
    longer read, or a file planted in a rank file's place, which stopped the run) found by its checksum."""
    name = f"damaged-{kind}"
    out_dir = workspace / name
    shutil.copytree(workspace / "reference", out_dir)
    shutil.rmtree(out_dir / "final")
    newest = out_dir / "step-00000008"
    size = (newest / RANK_1_SHARD).stat().st_size
    damage(newest)
    evidence = {str(p.relative_to(newest)): p.read_bytes() for p in newest.rglob("*") if p.is_file()}

    rerun = run_litsft(args_for(workspace, name), workspace)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    output = rerun.stdout + rerun.stderr
    aside = [p for p in out_dir.iterdir() if p.name.startswith("step-00000008.damaged-")]
    assert len(aside) == 1, sorted(p.name for p in out_dir.iterdir())
    how = expected.format(half=size // 2, size=size)
    assert (
        f"checkpoint {newest} is damaged: {how}; moved it aside to {aside[0].name}; resuming from step-00000006"
    ) in output
    assert f"Resumed from {out_dir / 'step-00000006'}" in output
    assert {
        str(p.relative_to(aside[0])): p.read_bytes() for p in aside[0].rglob("*") if p.is_file()
    } == evidence
    assert is_complete(newest)  # saved again, no collision with the damaged one
    assert_same_as_reference(workspace, name)


def test_full_disk_on_one_rank_while_writing_the_final_model_is_one_line_and_a_relaunch_finishes(
    workspace: Path,
) -> None:
    """Every rank writes its parts of the final model (DCP): rank 1 failing fails every rank together, with
    one line, no final/ and nothing half-written; the relaunch writes the same model as an uninterrupted run."""
    out_dir = workspace / "final-disk-full"
    args = args_for(workspace, "final-disk-full")
    run = run_litsft(args, workspace, fault="final_writing@1:enospc")
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("error:")] == [
        f"error: cannot write the final model to {out_dir / 'final'} (No space left on device: (fault injected at "
        "final_writing)); free disk space or fix permissions, then relaunch the same command: it resumes from "
        "the last checkpoint"
    ]
    assert not (out_dir / "final").exists() and leftovers(out_dir) == []
    assert run_litsft(args, workspace).returncode == 0
    assert_same_as_reference(workspace, "final-disk-full")


def test_full_disk_during_save_keeps_previous_checkpoint_and_names_the_cause(workspace: Path) -> None:
    out_dir = workspace / "disk-full"
    args = args_for(workspace, "disk-full")
    # Rank 1 finds the disk full while writing step 4: every rank stops with one message.
    run = run_litsft(args, workspace, fault="save_4_writing@1:enospc")
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    error_lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, error_lines
    assert error_lines[0].startswith(
        f"error: could not write checkpoint {out_dir / 'step-00000004'} (rank 1: [Errno 28] No space left on "
        "device: '(fault injected at save_4_writing)'; a step checkpoint of this run takes "
    ), error_lines
    assert f" on the disk of {out_dir}, where " in error_lines[0]
    assert error_lines[0].endswith(
        " was free); step-00000002 is intact: free disk space or fix permissions, then relaunch the same "
        "command to resume"
    ), error_lines
    assert latest_checkpoint(out_dir) == out_dir / "step-00000002"
    assert leftovers(out_dir) == []  # the partial step 4 is gone

    # A real write error: a 500 kB file-size limit (shards are about 1 MB) makes the kernel refuse the write.
    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000))

    run = run_litsft(args, workspace, preexec_fn=limit_file_size)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    error = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "File too large" in error[0] and "step-00000002 is intact" in error[0], error
    checkpoint = latest_checkpoint(out_dir)
    assert checkpoint == out_dir / "step-00000002" and is_complete(checkpoint)
    reader = stored_tensors(checkpoint)
    embedding = torch.zeros(reader.stored()["model/embed.weight"][0])
    reader.load({"model/embed.weight": embedding}, collective=False)
    assert embedding.abs().sum() > 0  # loadable, not just present
    assert leftovers(out_dir) == []
