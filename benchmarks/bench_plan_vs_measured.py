"""`litsft plan` against measured peak memory: 2-process finetune_full (or, with --qlora, finetune_lora
--quantize nf4) on this CPU, per sharding strategy.

python benchmarks/bench_plan_vs_measured.py [--steps 3] [--max_seq_length 256] [--qlora | --moe | --small] [--context 2]
    [--expert 2]

The model is a ~50M-parameter Llama shape (8 layers, hidden 768, GQA 12/4, MLP 2048; the demo tokenizer's
449-token vocabulary), so weights, gradients and AdamW state (16 bytes a parameter, 800 MB unsharded)
dominate the process's own baseline. Each run trains a few steps in 32-true (the CPU default) with
MALLOC_MMAP_THRESHOLD_=131072, so that large freed buffers go back to the OS and RSS follows what is live
(tutorials/cpu_distributed.md: glibc's default keeps them and hides FULL_SHARD's saving).

Measured = rank 0's peak RSS (its VmHWM) minus a baseline: the peak RSS of the identical run with a 2-layer,
hidden-64 model of the same vocabulary, which holds the interpreter, torch, Lightning, gloo, the tokenized
data and the loader but almost no model; what the planner counts for that small model is added back, so that
the baseline takes away the process and not a model. Taken twice: once the model is loaded (the
`--log.timings` report's peak RSS at the end of that phase) and for the whole run (metrics.csv's
peak_rss_mib), each against the baseline's at the same point, since a peak set while loading must not be
compared with a baseline peak set while training (which also holds the loss, autograd's and the optimizer's
own buffers). The larger of the two is the run's measured peak. Planned = `estimate_memory(...)` for the same
devices, strategy, precision, micro batch and sequence length: parameters + loading and the step's peak, the
larger being its total. Printed: both in MiB and the ratio of the totals (plan / measured); the planner's
claim is "within 15%".

--small: the whole process instead, for models small enough that the runtime dominates (SMALL_SHAPE, a 4-layer
hidden-256 Llama shape, and SMALL_MOE_SHAPE, the same with 8 experts of 512, 2 per token): measured = rank 0's
peak RSS itself, no baseline taken away; planned = `estimate_memory(...)`'s total plus the runtime `litsft plan`
prints beside it (litsft.training.plan.RUNTIME_BYTES). The runtime is measured first, as the resident memory of
a fresh process that has imported what a training process imports (`runtime_rss_mib`), and printed.

--context N: the runs split every row over N ranks (`--parallel.context N`; both processes read the same
micro-batch, so the global batch is 2 / N rows, one micro-batch a step), planned with `context=N`.

--expert N: with --moe, the model's runs split its experts over N ranks (`--parallel.expert N`: each holds E/N
whole experts and receives the assignments routed to them), planned with `expert=N`; the baseline (dense) model
runs as before.

--qlora: LoRA rank 8 on all-linear over an NF4 base (QLORA_SHAPE: 4 layers, hidden 1024, MLP 2816, whose
projections split into whole NF4 scale blocks over 2 ranks), baseline the same recipe on QLORA_BASELINE_SHAPE
(the smallest shape whose projections do; quantizing it takes 18 MiB, added back as above). Quantizing the
model's largest weight (2.9M values) while loading needs about as much as a step of 256 tokens.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import (
    bench_env,
    machine_description,
    make_checkpoint,
    run_litsft,
    training_rows,
    write_mixed_length_data,
)

from litsft.model.accounting.sizes import num_parameters
from litsft.model.config import Config
from litsft.model.lora.layers import LoRAConfig
from litsft.training.plan import RUNTIME_BYTES, estimate_memory

SHAPE = dict(num_layers=8, hidden_size=768, intermediate_size=2048, num_heads=12, num_kv_heads=4, head_dim=64)
BASELINE_SHAPE = dict(
    num_layers=2, hidden_size=64, intermediate_size=176, num_heads=4, num_kv_heads=2, head_dim=16
)
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
QLORA_SHAPE = dict(
    num_layers=4, hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4, head_dim=64
)
QLORA_BASELINE_SHAPE = dict(
    num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64
)
QLORA = LoRAConfig(rank=8, alpha=16, dropout=0.0)
QWEN3_MOE_BLOCK = dict(
    hf_architecture="Qwen3MoeForCausalLM",
    qk_norm=True,
    num_experts=8,
    experts_per_token=2,
    expert_intermediate_size=512,
    normalize_expert_weights=True,
    router_aux_loss_coef=0.001,
)
"""Qwen3-MoE's block: q/k norms and a routed MLP of 8 experts of 512, 2 per token."""
MOE_SHAPE = dict(SHAPE, **QWEN3_MOE_BLOCK)
"""--moe: SHAPE's attention with Qwen3-MoE's routed MLP, 8 experts of 512, 2 per token (75.5M of its 88.8M
parameters are experts)."""
SMALL_SHAPE = dict(
    num_layers=4, hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2, head_dim=64
)
SMALL_MOE_SHAPE = dict(SMALL_SHAPE, **QWEN3_MOE_BLOCK)
"""--small: a 4.2M-parameter dense model and a 13.6M-parameter mixture of experts whose plans (0.07-0.09 and
0.16-0.24 GiB per process at 256 tokens) are smaller than the runtime beside them."""
RUNTIME_IMPORTS = (
    "litsft.recipes.finetune_full",
    "litsft.recipes.finetune_lora",
    "litsft.training.engine",
    "litsft.training.parallel",
    "litsft.data",
)
"""What a training process has imported once the launcher has built its recipe (torch, Lightning, litsft)."""


LOADED_PHASE = "model: built, weights loaded, sharded"
"""The phase of the `--log.timings` report that ends once the model is loaded."""


def peak_rss_mib(
    checkpoint: Path, data: Path, strategy: str, args: argparse.Namespace, expert: int = 1
) -> tuple[float, float]:
    """Rank 0's peak RSS once the model is loaded, and over the whole run."""
    out_dir = args.work_dir / f"run-{checkpoint.name}-{strategy}"
    shutil.rmtree(out_dir, ignore_errors=True)
    recipe, extra = "finetune_full", []
    if args.qlora:
        recipe, extra = (
            "finetune_lora",
            ["--quantize", "nf4", "--lora.rank", str(QLORA.rank), "--lora.dropout", "0"],
        )
    _, stdout = run_litsft(
        [
            recipe, str(checkpoint), *extra, "--out_dir", str(out_dir), "--data", "JSON",
            "--data.json_path", str(data), "--data.prompt_style", "alpaca", "--devices", "2",
            "--fsdp.sharding_strategy", strategy, "--precision", "32-true", "--train.max_steps", str(args.steps),
            "--train.max_seq_length", str(args.max_seq_length), "--train.micro_batch_size", "1",
            "--train.global_batch_size", str(2 // args.context), "--parallel.context", str(args.context),
            "--parallel.expert", str(expert),
            "--eval.max_batches", "1", "--eval.max_new_tokens", "0", "--resume", "false", "--log.timings", "true",
        ],
        args.work_dir, threads=1, extra_env={"MALLOC_MMAP_THRESHOLD_": "131072"},
    )  # fmt: skip
    loaded = re.search(rf"^  {re.escape(LOADED_PHASE)} .* ([\d,]+) MiB peak RSS$", stdout, re.M)
    run = max(row["peak_rss_mib"] for row in training_rows(out_dir))
    return float(loaded.group(1).replace(",", "")), run


def long_rows(args: argparse.Namespace) -> dict[str, int]:
    """The models' context length when --max_seq_length is longer than demo-llama's."""
    length = Config.from_name("demo-llama").max_position_embeddings
    return {"max_position_embeddings": args.max_seq_length} if args.max_seq_length > length else {}


def records(args: argparse.Namespace) -> int:
    """Instruction records to write: 200 fill the rows of 256 tokens the runs take by default; longer rows
    take proportionally more, so that every packed row is full."""
    return 200 * max(1, args.max_seq_length // 256)


def runtime_rss_mib(work_dir: Path) -> float:
    """Peak RSS of a fresh process (one thread, as the runs) that has imported RUNTIME_IMPORTS and nothing else."""
    code = f"import {', '.join(RUNTIME_IMPORTS)}; from litsft.runtime.timings import peak_rss_bytes; print(peak_rss_bytes())"
    result = subprocess.run(
        [sys.executable, "-c", code], env=bench_env(work_dir, threads=1), capture_output=True, text=True,
        cwd=work_dir, check=True,
    )  # fmt: skip
    return int(result.stdout.split()[-1]) / 2**20


def whole_process(args: argparse.Namespace, data: Path) -> None:
    """--small: each model's whole-process peak against its plan's total plus the runtime."""
    runtime = [runtime_rss_mib(args.work_dir) for _ in range(3)]
    print(
        f"runtime: a fresh process that imported {', '.join(RUNTIME_IMPORTS)}: {', '.join(f'{r:.0f}' for r in runtime)} "
        f"MiB peak RSS (3 processes); litsft plan prints {RUNTIME_BYTES / 2**20:.0f} MiB"
    )
    print(
        f"{'model':<16}{'parameters':>11}{'strategy':>15}{'peak RSS':>10}{'planned':>9}{'+ runtime':>11}{'plan/peak':>11}"
    )
    for label, shape in (("dense", SMALL_SHAPE), ("MoE", SMALL_MOE_SHAPE)):
        model = make_checkpoint(args.work_dir / f"small-{label}", **shape, **long_rows(args))
        config = Config.from_checkpoint(model)
        for strategy in args.strategies:
            peak = max(peak_rss_mib(model, data, strategy, args))
            estimate = estimate_memory(
                config, devices=2, sharding_strategy=strategy, precision="32-true", micro_batch_size=1,
                max_seq_length=args.max_seq_length, context=args.context,
            )  # fmt: skip
            planned = (estimate.total + RUNTIME_BYTES) / 2**20
            print(
                f"{label:<16}{num_parameters(config) / 1e6:>10.1f}M{strategy:>15}{peak:>10.0f}"
                f"{estimate.total / 2**20:>9.0f}{planned:>11.0f}{planned / peak:>11.2f}",
                flush=True,
            )
    print(
        "MiB (2**20 bytes), rank 0; peak RSS = the larger of once loaded and over the run; plan/peak = (planned + runtime) / peak RSS"
    )


def main(args: argparse.Namespace) -> None:
    if args.expert > 1 and not args.moe:
        raise SystemExit("error: --expert needs --moe: only a mixture of experts has experts to split")
    args.work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="litsft-plan-"))
    args.work_dir.mkdir(parents=True, exist_ok=True)  # --small writes its data before any checkpoint
    os.environ["LITSFT_CACHE_DIR"] = str(args.work_dir / "cache")
    if args.small:
        data = write_mixed_length_data(args.work_dir / "train.json", records(args), max_words=400)
        print(machine_description())
        print(
            f"2 processes, context {args.context}, 32-true, micro batch 1 x {args.max_seq_length} tokens, "
            f"{args.steps} steps, MALLOC_MMAP_THRESHOLD_=131072"
        )
        whole_process(args, data)
        return
    shape = QLORA_SHAPE if args.qlora else MOE_SHAPE if args.moe else SHAPE
    model = make_checkpoint(args.work_dir / "model", **shape, **long_rows(args))
    baseline_model = make_checkpoint(
        args.work_dir / "baseline",
        **(QLORA_BASELINE_SHAPE if args.qlora else BASELINE_SHAPE),
        **long_rows(args),
    )
    # Long samples: every packed row is full, so each step holds max_seq_length tokens of activations.
    data = write_mixed_length_data(args.work_dir / "train.json", records(args), max_words=400)
    config = Config.from_checkpoint(model)
    print(machine_description())
    method = f"QLoRA rank {QLORA.rank} all-linear, NF4 base, " if args.qlora else ""
    print(
        f"{num_parameters(config) / 1e6:.1f}M parameters, {method}2 processes, context {args.context}, "
        f"expert {args.expert}, 32-true, micro batch 1 x "
        f"{args.max_seq_length} tokens, {args.steps} steps, MALLOC_MMAP_THRESHOLD_=131072"
    )
    print(f"{'':<15}{'baseline':>14}{'peak RSS':>14}{'measured':>14}{'planned':>14}")
    pairs = [("loaded", "run")] * 3 + [("loaded", "step")]
    print(f"{'strategy':<15}{''.join(f'{a:>7}{b:>7}' for a, b in pairs)}{'plan/measured':>15}")
    for strategy in args.strategies:
        baseline = peak_rss_mib(baseline_model, data, strategy, args)
        peak = peak_rss_mib(model, data, strategy, args, args.expert)
        estimate, baseline_estimate = (
            estimate_memory(
                Config.from_checkpoint(checkpoint), devices=2, sharding_strategy=strategy, precision="32-true",
                micro_batch_size=1, max_seq_length=args.max_seq_length, lora=QLORA if args.qlora else None,
                quantize="nf4" if args.qlora else None, context=args.context, expert=expert,
            )
            for checkpoint, expert in ((model, args.expert), (baseline_model, 1))
        )  # fmt: skip
        # The baseline's own model, as planned: once loaded, and at its peak.
        baseline_model_mib = [
            (baseline_estimate.parameters + baseline_estimate.loading) / 2**20,
            baseline_estimate.total / 2**20,
        ]
        measured = [p - b + m for p, b, m in zip(peak, baseline, baseline_model_mib)]
        planned = [(estimate.parameters + estimate.loading) / 2**20, estimate.step / 2**20]
        columns = "".join(f"{a:>7.0f}{b:>7.0f}" for a, b in (baseline, peak, measured, planned))
        print(f"{strategy:<15}{columns}{estimate.total / 2**20 / max(measured):>15.2f}", flush=True)
    print(
        "MiB (2**20 bytes), rank 0; measured = peak RSS - baseline + the baseline model as planned "
        "(loaded, whole run); plan/measured compares the larger of each pair"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max_seq_length", type=int, default=256)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--work_dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--qlora", action="store_true", help="finetune_lora --quantize nf4 instead")
    parser.add_argument("--moe", action="store_true", help="a mixture of experts (MOE_SHAPE) instead")
    parser.add_argument(
        "--context", type=int, default=1, choices=(1, 2), help="--parallel.context: ranks splitting each row"
    )
    parser.add_argument(
        "--expert",
        type=int,
        default=1,
        choices=(1, 2),
        help="--parallel.expert, with --moe: ranks splitting the experts",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="the whole process's peak for small models (SMALL_SHAPE, SMALL_MOE_SHAPE)",
    )
    main(parser.parse_args())
