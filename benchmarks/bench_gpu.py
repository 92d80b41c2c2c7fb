"""GPU throughput of a Llama-3.2-1B-shaped model: tokens/s, MFU and peak memory, torch.compile off and on.

python benchmarks/bench_gpu.py [--devices 1] [--steps 30] [--max_seq_length 4096]

Trains a randomly initialized Llama-3.2-1B (16 layers, hidden 2048, GQA 32/8, 128k vocabulary, tied
embeddings) with finetune_full on packed instruction data of mixed lengths (rows of 4096 tokens),
bf16-mixed, FULL_SHARD over `--devices` GPUs (one GPU: no FSDP), micro batch 1, once with
`--train.compile false` and once with `--train.compile true`. Figures are the engine's own metrics.csv
rows after the first `--warmup` steps (compilation and allocator warm-up left out): non-padding tokens/s,
per device, MFU against the GPU's datasheet bf16 peak, and peak allocated GPU memory next to
`litsft plan`'s estimate for the same run.

Not run on the CPU-only machine this was written on (see benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
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

from litsft.config import Config
from litsft.plan import estimate_memory

LLAMA_3_2_1B = "Llama-3.2-1B"


def main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU; on a CPU run bench_throughput.py")
    args.work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="litsft-gpu-"))
    os.environ["LITSFT_CACHE_DIR"] = str(args.work_dir / "cache")
    shape = Config.from_name(LLAMA_3_2_1B)
    # The demo tokenizer (449 tokens) with the real 128k-row embedding: the vocabulary's cost is Llama's.
    checkpoint = make_checkpoint(
        args.work_dir / "checkpoint",
        **{name: getattr(shape, name) for name in (
            "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
            "tie_word_embeddings", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
        )},
    )  # fmt: skip
    config = Config.from_checkpoint(checkpoint)
    data = write_mixed_length_data(args.work_dir / "train.json", 20_000, max_words=4000)
    planned = (
        estimate_memory(
            config, devices=args.devices, precision="bf16-mixed", max_seq_length=args.max_seq_length
        ).total
        / 2**20
    )
    print(machine_description(), "|", torch.cuda.get_device_name())
    print(
        f"{config.num_parameters / 1e9:.2f}B parameters, {args.devices} GPU(s) FULL_SHARD, bf16-mixed, packed rows "
        f"of {args.max_seq_length}, micro batch 1, {args.steps} steps ({args.warmup} warm-up left out)"
    )
    for compile_blocks in (False, True):
        out_dir = args.work_dir / f"compile-{compile_blocks}"
        shutil.rmtree(out_dir, ignore_errors=True)
        run_litsft(
            [
                "finetune_full", str(checkpoint), "--out_dir", str(out_dir), "--data", "JSON",
                "--data.json_path", str(data), "--data.prompt_style", "alpaca", "--devices", str(args.devices),
                "--precision", "bf16-mixed", "--train.compile", str(compile_blocks).lower(),
                "--train.max_steps", str(args.steps), "--train.max_seq_length", str(args.max_seq_length),
                "--train.micro_batch_size", "1", "--train.global_batch_size", str(args.devices),
                "--train.log_interval", "1", "--eval.max_batches", "1", "--eval.max_new_tokens", "0",
                "--resume", "false",
            ],
            args.work_dir, threads=8,
        )  # fmt: skip
        rows = training_rows(out_dir)[args.warmup :]
        print(
            f"compile {'on ' if compile_blocks else 'off'}: {median([r['tokens_per_second'] for r in rows]):,.0f} tokens/s, "
            f"{median([r['tokens_per_second_per_device'] for r in rows]):,.0f} per device, "
            f"MFU {median([r.get('mfu', float('nan')) for r in rows]):.1%}, "
            f"peak allocated {max(r['peak_gpu_memory_allocated_mib'] for r in rows):,.0f} MiB "
            f"(plan {planned:,.0f} MiB), peak RSS {max(r['peak_rss_mib'] for r in rows):,.0f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max_seq_length", type=int, default=4096)
    parser.add_argument("--work_dir", default=None, help="default: a new temporary directory")
    main(parser.parse_args())
