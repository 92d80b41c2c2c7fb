"""The README's main job: a tiny model trained on the demo data with 2 processes FULL_SHARD.

Run whole (800 steps, 2 to 4 minutes on 2 cores): at 400 steps the held-out score sits on the steep part of
the curve. At 800 steps the score measured 87-97% over seeds 1337, 7 and 3 with the CPU's AVX-512 kernels
and with AVX2 and SSE4.2 ones forced (benchmarks/results/demo_score_by_isa_cpu.txt), so the 70% bar leaves
room on a CPU whose float kernels round differently."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from launch import litsft

METRIC_COLUMNS = {"step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second",
                  "tokens_per_second_per_device", "mfu", "peak_rss_mib", "val_loss", "val_perplexity"}  # fmt: skip


def test_demo_learns_the_held_out_tasks_and_exports(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = litsft(["demo", "--out_dir", str(out)], tmp_path)
    before, after = (float(x) / 100 for x in re.search(
        r"Held-out exact match: ([\d.]+)% before training -> ([\d.]+)% after", result.stdout).groups())  # fmt: skip
    print(f"held-out exact match {before:.0%} -> {after:.0%}")
    assert before <= 0.05 and after >= 0.7

    rows = list(csv.DictReader((out / "finetune" / "metrics.csv").open()))
    assert METRIC_COLUMNS <= set(rows[0])
    losses = [float(r["loss"]) for r in rows if r["loss"]]
    assert losses[-1] < 0.5 * losses[0]
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [400, 800]  # every --eval.interval and the end
    assert (out / "finetune" / "loss.png").stat().st_size > 5000
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "model.safetensors").is_file()
