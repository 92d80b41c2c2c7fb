"""Crash a 2-process FULL_SHARD run (SIGKILL of the whole process group) at ten named moments, mid-checkpoint
included, relaunch the same command after each, and check the final weights are bit-identical to an
uninterrupted run's. Prints "N/N kills recovered". About 20 runs of a tiny model: a few minutes on 2 cores.

python benchmarks/bench_fault_injection.py [--points after_step_1 save_4_before_rename ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the crash harness and tiny checkpoints live with the tests

from crash_harness import (  # noqa: E402
    FAULT_POINTS,
    crash_and_recover,
    leftovers,
    logged_steps,
    run_litsft,
    train_args,
)
from launch import max_difference, write_records, write_tiny_checkpoint  # noqa: E402


def main(points: list[str]) -> int:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        base, data = write_tiny_checkpoint(root / "base", seed=1), write_records(root / "data.json")
        reference = run_litsft(train_args(base, data, root / "reference"), root)
        assert reference.returncode == 0, reference.stderr[-3000:]
        print(f"uninterrupted run: {reference.seconds:.1f} s", flush=True)
        recovered = 0
        for i, point in enumerate(points):
            out_dir = root / f"crash-{i}"
            try:
                runs = crash_and_recover(train_args(base, data, out_dir), root, [point])
                difference = max_difference(root / "reference" / "final", out_dir / "final")
                steps, junk = logged_steps(out_dir), leftovers(out_dir)
                ok = difference == 0.0 and steps == list(range(1, 9)) and not junk
                detail = f"max |difference| {difference}, steps logged {steps}, leftovers {junk}"
                seconds = sum(run.seconds for run in runs)
            except AssertionError as err:
                ok, detail, seconds = False, str(err).splitlines()[0], 0.0
            recovered += ok
            print(
                f"{'recovered' if ok else 'FAILED   '} kill at {point:<26} ({seconds:5.1f} s): {detail}",
                flush=True,
            )
    print(f"{recovered}/{len(points)} kills recovered in {time.perf_counter() - started:.0f} s")
    return 0 if recovered == len(points) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--points", nargs="+", default=FAULT_POINTS, help="fault points (see litsft/runtime/faults.py)"
    )
    sys.exit(main(parser.parse_args().points))
