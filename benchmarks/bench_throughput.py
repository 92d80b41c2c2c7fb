"""litsft training throughput on this machine: full and LoRA fine-tuning, one process and 2 processes under
each sharding strategy. Prints non-padding tokens/s, tokens/s per device, MFU and peak RSS.

python benchmarks/bench_throughput.py [--steps 12] [--threads 1] [--model demo-llama]

Packed instruction data of mixed lengths (rows of --max_seq_length), 32-true, micro batch 4, global
batch 8 (one process: 2 accumulation steps; two: 1). Figures are medians of the engine's own per-step
metrics.csv rows after the first 2 steps. The engine reports no MFU on a CPU (no datasheet peak), so MFU
here is against this CPU's measured fp32 matmul rate with the same threads (a 2048^3 matmul): an upper
bound the model's small matmuls cannot reach, not a vendor peak. Two processes on a 2-core machine prove the
distributed path; they do not add compute (tutorials/cpu_distributed.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from harness import (
    machine_description,
    make_checkpoint,
    median,
    run_litsft,
    training_rows,
    write_mixed_length_data,
)

from litsft.model.accounting.flops import flops_per_token
from litsft.model.accounting.sizes import num_parameters
from litsft.model.config import Config

RUNS = (
    ("full", 1, "NO_SHARD"),
    ("full", 2, "FULL_SHARD"),
    ("full", 2, "SHARD_GRAD_OP"),
    ("full", 2, "NO_SHARD"),
    ("lora", 1, "NO_SHARD"),
    ("lora", 2, "FULL_SHARD"),
)


def matmul_flops_per_second(threads: int, size: int = 2048) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    started = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * size**3 / (time.perf_counter() - started)


def main(args: argparse.Namespace) -> None:
    args.work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="litsft-throughput-"))
    os.environ["LITSFT_CACHE_DIR"] = str(args.work_dir / "cache")
    checkpoint = make_checkpoint(args.work_dir / "checkpoint")
    config = Config.from_checkpoint(checkpoint)
    data = write_mixed_length_data(args.work_dir / "train.json", 2000, max_words=400)
    peak = matmul_flops_per_second(args.threads)
    print(machine_description())
    print(
        f"{config.name}, {num_parameters(config) / 1e6:.2f}M parameters, packed rows of {args.max_seq_length}, "
        f"32-true, micro batch 4, global batch 8, {args.threads} thread(s) per process, "
        f"measured matmul peak {peak / 1e9:.1f} GFLOP/s per process"
    )
    print(f"{'run':<32}{'tokens/s':>10}{'per device':>12}{'MFU':>8}{'peak RSS MiB':>14}")
    for method, devices, strategy in RUNS:
        out_dir = args.work_dir / f"{method}-{devices}-{strategy}"
        shutil.rmtree(out_dir, ignore_errors=True)
        run_litsft(
            [
                f"finetune_{method}", str(checkpoint), "--out_dir", str(out_dir), "--data", "JSON",
                "--data.json_path", str(data), "--data.prompt_style", "alpaca", "--devices", str(devices),
                "--fsdp.sharding_strategy", strategy, "--precision", "32-true", "--train.max_steps", str(args.steps),
                "--train.max_seq_length", str(args.max_seq_length), "--train.micro_batch_size", "4",
                "--train.global_batch_size", "8", "--train.log_interval", "1", "--eval.max_batches", "1",
                "--eval.max_new_tokens", "0", "--resume", "false",
            ],
            args.work_dir, args.threads,
        )  # fmt: skip
        rows = training_rows(out_dir)[2:]
        tokens_per_second = median([r["tokens_per_second"] for r in rows])
        trainable = "lora" if method == "lora" else "all"
        mfu = flops_per_token(config, args.max_seq_length, trainable) * tokens_per_second / (peak * devices)
        name = f"finetune_{method} {devices} proc" + (f" {strategy}" if devices > 1 else "")
        print(
            f"{name:<32}{tokens_per_second:>10,.0f}{tokens_per_second / devices:>12,.0f}{mfu:>8.1%}"
            f"{max(r['peak_rss_mib'] for r in rows):>14,.0f}",
            flush=True,
        )
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max_seq_length", type=int, default=512)
    parser.add_argument("--work_dir", default=None, help="default: a new temporary directory")
    main(parser.parse_args())
