"""The reliability parts in isolation: the out_dir lock, checkpoint completeness and rotation, the fault hook,
one-line CLI errors. (End to end: test_fault_injection.py and test_bad_inputs.py.)"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import launch
import pytest
from launch import free_port, write_records, write_tiny_checkpoint

from litsft.checkpoint.training_checkpoint import (
    is_complete,
    latest_checkpoint,
    remove_partial_checkpoints,
    rotate_checkpoints,
)
from litsft.errors import LitsftError
from litsft.runtime.faults import FAULT_ENV, fault_point
from litsft.runtime.rendezvous import TIMEOUT_ENV
from litsft.runtime.run_lock import LOCK_NAME, STALE_AFTER_S, RunLock, process_start_time, read_holder


# ---- the out_dir lock ----------------------------------------------------------------------------------
def test_lock_names_its_holder_and_refuses_a_second_run(tmp_path: Path) -> None:
    with RunLock(tmp_path / "out"):
        holder = read_holder(tmp_path / "out" / LOCK_NAME)
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(
            LitsftError, match=rf"is in use by a running litsft run \(host .*, pid {os.getpid()},"
        ):
            RunLock(tmp_path / "out").acquire()
    assert not (tmp_path / "out").exists(), "a run that wrote nothing leaves no empty out_dir behind"


def write_lock(out_dir: Path, **holder: object) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    path.write_text(json.dumps({"started": "2026-01-01 00:00:00", **holder}))
    return path


def test_lock_of_a_dead_pid_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, host=socket.gethostname(), pid=dead.pid, start_time=None)
    with RunLock(tmp_path):
        assert read_holder(tmp_path / LOCK_NAME)["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_a_reused_pid_is_taken_over(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A live process holds the pid the lock names, but it started after the lock was written: another
    process, the holder is gone. The lock is taken over and names the new holder; the same lock naming that
    process's own start time is refused."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = process_start_time(other.pid)
        assert started is not None
        write_lock(tmp_path, host=socket.gethostname(), pid=other.pid, start_time=started)
        with pytest.raises(LitsftError, match=rf"in use by a running litsft run \(host .*, pid {other.pid},"):
            RunLock(tmp_path).acquire()

        write_lock(tmp_path, host=socket.gethostname(), pid=other.pid, start_time=started - 1)
        with RunLock(tmp_path):
            holder = read_holder(tmp_path / LOCK_NAME)
            assert (holder["host"], holder["pid"], holder["start_time"]) == (
                socket.gethostname(),
                os.getpid(),
                process_start_time(os.getpid()),
            )
        assert capsys.readouterr().out == (
            f"Taking over {tmp_path / LOCK_NAME} from a run that is gone "
            f"(host {socket.gethostname()}, pid {other.pid}, started 2026-01-01 00:00:00)\n"
        )
        assert other.poll() is None, "the process that reused the pid is left alone"
    finally:
        other.kill()
        other.wait()


def test_lock_from_another_host_is_stale_only_when_its_heartbeat_stopped(tmp_path: Path) -> None:
    path = write_lock(tmp_path, host="node-17", pid=1234, start_time=5)
    with pytest.raises(LitsftError, match="host node-17, pid 1234"):
        RunLock(tmp_path).acquire()
    old = time.time() - STALE_AFTER_S - 1
    os.utime(path, (old, old))
    with RunLock(tmp_path):
        assert read_holder(path)["host"] == socket.gethostname()


# ---- checkpoints ----------------------------------------------------------------------------------------
def fake_checkpoint(out_dir: Path, step: int) -> Path:
    directory = out_dir / f"step-{step:08d}"
    (directory / "shards").mkdir(parents=True)
    (directory / "shards" / "rank-00000.safetensors").write_bytes(b"x" * 10)
    files = {"shards/rank-00000.safetensors": 10}
    (directory / "trainer_state.json").write_text(json.dumps({"files": list(files), "file_sizes": files}))
    return directory


def test_a_truncated_file_makes_a_checkpoint_incomplete(tmp_path: Path) -> None:
    complete, newer = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 4)
    (newer / "shards" / "rank-00000.safetensors").write_bytes(b"x" * 9)
    assert is_complete(complete) and not is_complete(newer)
    assert latest_checkpoint(tmp_path) == complete


def test_rotation_keeps_the_newest_complete_checkpoints_and_counts_no_incomplete_one(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "step-00000010").mkdir()  # being written by no one: incomplete, not counted
    rotate_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000008", "step-00000010"]


def test_leftovers_of_interrupted_saves_and_deletes_are_removed(tmp_path: Path) -> None:
    kept = fake_checkpoint(tmp_path, 2)
    (tmp_path / ".step-00000004.partial" / "shards").mkdir(parents=True)
    (tmp_path / ".step-00000000.deleting").mkdir()
    remove_partial_checkpoints(tmp_path)
    assert list(tmp_path.iterdir()) == [kept]


# ---- the fault hook ------------------------------------------------------------------------------------
def test_fault_hook_is_inert_unless_it_names_this_point_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    fault_point("save_4_writing")  # unset: nothing happens
    monkeypatch.setenv(FAULT_ENV, "save_4_writing@1:enospc")
    fault_point("save_4_writing", rank=0)  # another rank
    fault_point("save_2_writing", rank=1)  # another point
    with pytest.raises(OSError) as err:
        fault_point("save_4_writing", rank=1)
    assert err.value.errno == errno.ENOSPC


# ---- several nodes: the rendezvous ends ------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_node_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two-nodes")
    write_tiny_checkpoint(root / "base", seed=1)
    write_records(root / "data.json", count=16)
    return root


def start_node_0(root: Path, out_dir: Path, port: int, **env: str) -> subprocess.Popen:
    """Node 0 of a --num_nodes 2 run started by hand (as on a cluster without torchrun or SLURM)."""
    args = [
        "finetune_full", str(root / "base"), "--out_dir", str(out_dir), "--num_nodes", "2",
        "--data", "JSON", "--data.json_path", str(root / "data.json"), "--train.max_steps", "1",
        "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--train.max_seq_length", "64",
    ]  # fmt: skip
    environment = dict(launch.test_env(root), MASTER_PORT=str(port), **env)
    return subprocess.Popen(
        [sys.executable, "-m", "litsft", *args],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_several_nodes_without_anything_starting_the_others_are_refused_at_once(
    two_node_inputs: Path,
) -> None:
    out_dir = two_node_inputs / "no-launcher"
    process = start_node_0(two_node_inputs, out_dir, free_port())
    stdout, stderr = process.communicate(timeout=launch.DEADLINE_S)
    assert process.returncode == 2, stderr[-3000:]
    assert stderr.strip().splitlines() == [stderr.strip()]
    assert "--num_nodes 2 needs a process started on every node" in stderr and "torchrun" in stderr
    assert not out_dir.exists()


def test_a_node_that_never_joins_ends_the_wait_after_the_timeout_in_one_line(two_node_inputs: Path) -> None:
    out_dir, port = two_node_inputs / "never-joins", free_port()
    env = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", TIMEOUT_ENV: "3"}
    process = start_node_0(two_node_inputs, out_dir, port, **env)
    stdout, stderr = process.communicate(timeout=launch.DEADLINE_S)
    assert process.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1:] == [  # after Fabric's "Initializing distributed" line
        f"error: gave up after 3 s waiting for the 2 processes of --devices 1 x --num_nodes 2 to join at "
        f"127.0.0.1:{port} (this is node 0 of 2); start the same command on every node, or set {TIMEOUT_ENV} "
        "(seconds) to wait longer"
    ]
    assert not out_dir.exists()  # the lock was given back and the out_dir it created removed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_wait_for_a_node_at_once(two_node_inputs: Path, sig: signal.Signals) -> None:
    out_dir, port = two_node_inputs / f"waiting-{sig.name}", free_port()
    process = start_node_0(two_node_inputs, out_dir, port, NODE_RANK="0", MASTER_ADDR="127.0.0.1")
    deadline = time.monotonic() + launch.DEADLINE_S
    while not port_is_open(port) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # node 0 serves the rendezvous on MASTER_PORT while it waits
    assert port_is_open(port), process.communicate()[1][-3000:]
    signalled = time.monotonic()
    os.killpg(process.pid, sig)
    stdout, stderr = process.communicate(timeout=launch.DEADLINE_S)
    assert time.monotonic() - signalled < 10
    assert process.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert stderr.strip().splitlines()[-1:] == [
        f"Stopped by {sig.name} while waiting for the 2 processes of --devices 1 x --num_nodes 2 to join at "
        f"127.0.0.1:{port} (this is node 0 of 2); nothing was written"
    ]
    assert not out_dir.exists()


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_resume_on_another_number_of_processes_counts_them_in_words() -> None:
    from litsft.training.checkpointer import resharding_notice

    assert resharding_notice(Path("out/step-00000004"), 1, 2).startswith(
        "Resuming out/step-00000004 (written by 1 process) on 2:"
    )
    assert "(written by 2 processes) on 1:" in resharding_notice(Path("out/step-00000004"), 2, 1)
