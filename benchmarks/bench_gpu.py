"""litsft against a plain transformers training loop on one GPU: tokens/s, MFU and peak memory.

python benchmarks/bench_gpu.py [--steps 40] [--warmup 10] [--max_seq_length 4096] [--lora_rank 16]
    [--records 20000] [--float8 tensorwise|rowwise|none] [--results_json results.json]
python benchmarks/bench_gpu.py --context_sizes 1 2 --max_seq_length 32768 [--steps 12 --warmup 4] [--results_json ...]

In one invocation, on a randomly initialized Llama-3.2-1B shape (16 layers, hidden 2048, GQA 32/8, 128k
vocabulary, tied embeddings), bf16-mixed, packed rows of `--max_seq_length` tokens of instruction data of
mixed lengths, micro batch 1:

1. litsft finetune_full through the real engine (`python -m litsft`, compile on: the GPU default);
2. litsft finetune_lora, rank `--lora_rank`, alpha twice the rank, all linear projections;
3. a plain transformers LlamaForCausalLM loop as a user writes it: bf16 autocast over fp32 weights, fused
   AdamW, each decoder layer compiled, sdpa attention, no KV cache (`use_cache=False`), on the same rows
   litsft's loader makes. Its attention is plain causal over the whole packed row, end padding included:
   it does not keep documents apart, so it does more attention work than litsft's per-document attention
   (and computes the padding), not the same work; its attention over whole rows is an upper bound on the
   work the task needs;
4. litsft finetune_full again with `--train.float8` (tensorwise by default; `--float8 none` skips it), whose
   loss at each logged step is compared with finetune_full's (the same data, seed and steps).

Each litsft run's measured peak is compared with `litsft plan`'s estimate for the same run
(litsft.training.plan.estimate_memory: one device, bf16-mixed, micro batch 1, --max_seq_length), and
`--results_json` gets every figure, rewritten after each run so that a run cut short keeps what finished.

Timing leaves the first `--warmup` steps out (compilation, allocator warm-up) on every side. litsft logs every
`--warmup` steps (`--train.log_interval`), so it synchronizes with the GPU about as rarely as the plain loop;
its tokens/s come from its own metrics.csv rows after the first. Tokens are the non-padding input tokens on
every side. MFU counts the FLOPs each side executes (litsft.model.accounting.flops.executed_training_flops) over the GPU's
datasheet bf16 peak: litsft's blocks on the real tokens, its output head on the loss tokens only and
attention within each document; the plain loop's blocks and head on every position of the row and causal
attention over the whole row. Each run's line is printed as soon as it finishes, then the ratios.

--moe_layers N: instead, a mixture of experts: Qwen3-30B-A3B's layer shape (128 experts, 8 per token, GQA 32/4,
151k vocabulary) cut to N of its 48 layers, bf16-mixed, packed rows of `--max_seq_length`, micro batch 1, on one
GPU: litsft finetune_full (experts through torch._grouped_mm) and the plain loop of item 3 on transformers'
Qwen3MoeForCausalLM (its own expert implementation), on the same rows; MFU counts the 8 chosen experts a token
runs, on both sides. One GPU holds every expert, so there is no expert parallelism in this row.

--context_sizes: instead, finetune_full once per context size (`--parallel.context`) on the same model, with
full activation checkpointing, on two GPUs of this machine (one when it has one: a context size larger than
the GPUs is skipped and its reason recorded), one row per data replica and step; tokens/s per GPU and MFU as
litsft's metrics.csv logs them (rows after the first), the peak against the plan. The anchor printed beside
them is torchtitan's published Llama 3.1 8B table (CONTEXT_ANCHOR), another model on other GPUs: a scale to
read the figures against, not a target.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from harness import (
    machine_description,
    make_checkpoint,
    median,
    run_litsft,
    training_rows,
    write_mixed_length_data,
)

from litsft.model.accounting.flops import device_peak_flops, executed_training_flops, lora_parameters
from litsft.model.accounting.sizes import num_parameters
from litsft.model.config import Config
from litsft.model.lora.layers import LoRAConfig
from litsft.training.plan import estimate_memory

LLAMA_3_2_1B = "Llama-3.2-1B"
QWEN3_MOE = "Qwen3-30B-A3B"
MOE_FIELDS = (
    "qk_norm", "num_experts", "experts_per_token", "expert_intermediate_size", "normalize_expert_weights",
    "router_aux_loss_coef", "hf_architecture", "rms_norm_eps",
)  # fmt: skip
"""Beyond SHAPE_FIELDS, what makes the --moe_layers model Qwen3-30B-A3B's."""
CONTEXT_ANCHOR = {
    "source": "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md (Table 2)",
    "setup": "Llama 3.1 8B, 8x H100 (96 GB HBM2e, 500 W), FSDP + CP (ring attention) + torch.compile + Float8, "
    "local batch 1, full activation checkpointing",
    "tokens_per_second_per_gpu": {"32768 tokens, CP 1": 3890, "131072 tokens, CP 4": 1071},
}
"""What torchtitan's team published for context parallelism on one node, to read --context_sizes against."""
SHAPE_FIELDS = (
    "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
    "tie_word_embeddings", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
)  # fmt: skip


def litsft_rows(
    recipe: str,
    checkpoint: Path,
    data: Path,
    args: argparse.Namespace,
    *extra: str,
    devices: int = 1,
    context: int = 1,
) -> list[dict[str, float]]:
    """Run a litsft recipe on `devices` GPUs, one row per data replica and step; its metrics.csv rows."""
    out_dir = args.work_dir / "_".join([recipe, *extra]).replace("--", "").replace(".", "-")  # one per run
    shutil.rmtree(out_dir, ignore_errors=True)
    run_litsft(
        [
            recipe, str(checkpoint), "--out_dir", str(out_dir), "--data", "JSON", "--data.json_path", str(data),
            "--data.prompt_style", "alpaca", "--devices", str(devices), "--precision", "bf16-mixed",
            "--train.max_steps", str(args.steps), "--train.max_seq_length", str(args.max_seq_length),
            "--train.micro_batch_size", "1", "--train.global_batch_size", str(devices // context),
            "--train.log_interval", str(args.warmup),
            "--eval.max_batches", "1", "--eval.max_new_tokens", "0", "--resume", "false", *extra,
        ],
        args.work_dir, threads=8, capture=False,  # into the step's log as it runs: a timed-out run shows how far it got
    )  # fmt: skip
    return training_rows(out_dir)


def litsft_run(
    recipe: str, checkpoint: Path, data: Path, args: argparse.Namespace, work: list[StepWork], *extra: str
) -> dict:
    rows = litsft_rows(recipe, checkpoint, data, args, *extra)
    return {
        **measured_rates(rows, work, device_peak_flops(torch.device("cuda"), "bf16-mixed")),
        "peak_mib": max(r["peak_gpu_memory_allocated_mib"] for r in rows),
        "losses": {int(r["step"]): r["loss"] for r in rows},
    }


def planned_peak_mib(config: Config, args: argparse.Namespace, lora: LoRAConfig | None = None) -> float:
    """What `litsft plan` estimates for one of the benchmark's litsft runs, in MiB."""
    estimate = estimate_memory(
        config, devices=1, precision="bf16-mixed", micro_batch_size=1, max_seq_length=args.max_seq_length,
        lora=lora,
    )  # fmt: skip
    return estimate.total / 2**20


def loss_difference(losses: dict[int, float], reference: dict[int, float]) -> float:
    """The largest relative difference of two runs' losses over the steps both logged."""
    steps = sorted(set(losses) & set(reference))
    return max(abs(losses[step] - reference[step]) / abs(reference[step]) for step in steps)


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step of one side processes: non-padding input tokens and executed FLOPs."""

    tokens: int
    flops: float


def measured_rates(rows: list[dict[str, float]], work: list[StepWork], peak_flops: float | None) -> dict:
    """tokens/s and MFU over litsft's metrics.csv rows after the first (which holds the warm-up steps). A row
    at step s gives the rate over the steps since the previous row; with the tokens those steps held, that
    is their time, and the executed FLOPs over all of it is the MFU."""
    seconds, tokens, flops = 0.0, 0, 0.0
    for previous, row in zip(rows, rows[1:]):
        window = work[int(previous["step"]) : int(row["step"])]
        window_tokens = sum(step.tokens for step in window)
        seconds += window_tokens / row["tokens_per_second"]
        tokens += window_tokens
        flops += sum(step.flops for step in window)
    if seconds == 0:
        raise SystemExit("error: litsft logged no step after the warm-up; raise --steps")
    return {
        "tokens_per_second": tokens / seconds,
        "mfu": flops / seconds / peak_flops if peak_flops else float("nan"),
    }


def step_work(
    config: Config,
    batches: list[dict[str, torch.Tensor]],
    side: Literal["litsft", "plain"],
    trainable: Literal["all", "lora"] = "all",
    adapter_parameters: int = 0,
) -> list[StepWork]:
    """Per step, the tokens and the FLOPs `side` executes on these micro-batches (one per step): litsft per
    document with the head on the loss tokens, the plain loop causal over the whole row, head everywhere."""
    work = []
    for batch in batches:
        tokens = int((batch["document_ids"] >= 0).sum())
        if side == "litsft":
            lengths = torch.diff(batch["cu_seqlens"]).tolist()
            head_tokens = int((batch["labels"] != -100).sum())
        else:
            lengths, head_tokens = [batch["input_ids"].shape[1]], batch["input_ids"].shape[1]
        flops = executed_training_flops(config, lengths, head_tokens, trainable, adapter_parameters)
        work.append(StepWork(tokens, flops))
    return work


def print_result(name: str, result: dict) -> None:
    print(
        f"{name:34s} {result['tokens_per_second']:>9,.0f} tokens/s  MFU {result['mfu']:6.1%}  "
        f"peak allocated {result['peak_mib']:>8,.0f} MiB",
        flush=True,
    )


def packed_batches(checkpoint: Path, data: Path, args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """The micro-batches litsft's loader gives finetune_full (same data, seed and packing)."""
    from litsft.data import JSON
    from litsft.data.tokenizer import Tokenizer

    module = JSON(json_path=data, prompt_style="alpaca")
    module.connect(Tokenizer(checkpoint), max_seq_length=args.max_seq_length, seed=1337)
    module.prepare()
    module.setup()
    loader = module.train_dataloader(rank=0, world_size=1, micro_batch_size=1, global_batch_size=1)
    loader.set_epoch(0)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == args.steps:
            return batches
    raise SystemExit(f"error: the data gives {len(batches)} rows, fewer than --steps {args.steps}")


def transformers_run(
    config: Config, batches: list[dict[str, torch.Tensor]], args: argparse.Namespace, work: list[StepWork]
) -> dict:
    """The plain loop: the config's transformers class (LlamaForCausalLM, Qwen3MoeForCausalLM), sdpa, compiled
    layers, bf16 autocast, fused AdamW, no KV cache."""
    import transformers

    hf_fields = config.to_hf_config()
    hf_config = transformers.AutoConfig.for_model(hf_fields.pop("model_type"), **hf_fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    # fp32 weights under bf16 autocast, as litsft's bf16-mixed (the config's torch_dtype may say bfloat16).
    model = model.to(device="cuda", dtype=torch.float32).train()
    for layer in model.model.layers:
        layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    torch.cuda.reset_peak_memory_stats()
    started = 0.0
    for step, batch in enumerate(batches):
        if step == args.warmup:
            torch.cuda.synchronize()
            started = time.perf_counter()
        input_ids = batch["input_ids"].cuda(non_blocking=True)
        # litsft's labels are already shifted (label t is the target of input t); transformers shifts itself.
        labels = torch.cat([torch.full_like(batch["labels"][:, :1], -100), batch["labels"][:, :-1]], dim=1)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=input_ids, labels=labels.cuda(non_blocking=True), use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    measured = work[args.warmup : len(batches)]
    peak = device_peak_flops(torch.device("cuda"), "bf16-mixed")
    return {
        "tokens_per_second": sum(step.tokens for step in measured) / seconds,
        "mfu": sum(step.flops for step in measured) / seconds / peak if peak else float("nan"),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
    }


def context_runs(config: Config, checkpoint: Path, data: Path, args: argparse.Namespace) -> dict:
    """--context_sizes: finetune_full at each context size on two GPUs (one if that is all), tokens/s per GPU."""
    gpus = torch.cuda.device_count()
    devices = min(2, gpus)
    results: dict = {
        "gpus_used": devices,
        "gpus_found": gpus,
        "anchor": CONTEXT_ANCHOR,
        "runs": {},
        "skipped": {},
    }
    for context in args.context_sizes:
        name = f"context_{context}"
        if context > devices:
            results["skipped"][name] = (
                f"--parallel.context {context} needs {context} GPUs of one node; found {gpus}"
            )
            print(f"{name:34s} skipped: {results['skipped'][name]}", flush=True)
            continue
        rows = litsft_rows(
            "finetune_full", checkpoint, data, args, "--parallel.context", str(context),
            "--fsdp.activation_checkpointing", "true", devices=devices, context=context,
        )  # fmt: skip
        measured = rows[1:]  # the first row holds the warm-up steps
        if not measured:
            raise SystemExit("error: litsft logged no step after the warm-up; raise --steps")
        planned = estimate_memory(
            config, devices=devices, precision="bf16-mixed", micro_batch_size=1, max_seq_length=args.max_seq_length,
            activation_checkpointing=True, context=context,
        )  # fmt: skip
        result = {
            "devices": devices,
            "context": context,
            "tokens_per_second_per_gpu": median([r["tokens_per_second_per_device"] for r in measured]),
            "mfu": median([r["mfu"] for r in measured]) if all("mfu" in r for r in measured) else None,
            "peak_mib": max(r["peak_gpu_memory_allocated_mib"] for r in rows),
            "planned_peak_mib": planned.total / 2**20,
        }
        results["runs"][name] = result
        mfu = "—" if result["mfu"] is None else f"{result['mfu']:.1%}"
        print(
            f"{name:34s} {result['tokens_per_second_per_gpu']:>9,.0f} tokens/s per GPU on {devices}  MFU {mfu}  "
            f"peak allocated {result['peak_mib']:>8,.0f} MiB (plan {result['planned_peak_mib']:,.0f})",
            flush=True,
        )
        if args.results_json:
            Path(args.results_json).write_text(json.dumps(results, indent=1))
    anchors = ", ".join(f"{k}: {v:,}" for k, v in CONTEXT_ANCHOR["tokens_per_second_per_gpu"].items())
    print(f"torchtitan, {CONTEXT_ANCHOR['setup']}: {anchors} tokens/s per GPU ({CONTEXT_ANCHOR['source']})")
    return results


def moe_runs(
    config: Config,
    checkpoint: Path,
    data: Path,
    batches: list[dict[str, torch.Tensor]],
    args: argparse.Namespace,
) -> None:
    """--moe_layers: finetune_full and the transformers loop on the cut-down Qwen3-30B-A3B, each row written to
    --results_json as soon as it finishes."""
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "machine": machine_description(),
        "model": f"{QWEN3_MOE}'s layers, {args.moe_layers} of 48",
        "parameters": num_parameters(config),
        "settings": {name: value for name, value in vars(args).items() if name != "work_dir"},
        "runs": {},
    }
    full = litsft_run("finetune_full", checkpoint, data, args, step_work(config, batches, "litsft"))
    results["runs"]["finetune_full"] = {**full, "planned_peak_mib": planned_peak_mib(config, args)}
    print_result("finetune_full (MoE)", full)
    if args.results_json:
        Path(args.results_json).write_text(json.dumps(results, indent=1))
    plain = transformers_run(config, batches, args, step_work(config, batches, "plain"))
    results["runs"]["transformers_loop"] = plain
    results["full_over_transformers_loop"] = full["tokens_per_second"] / plain["tokens_per_second"]
    print_result("transformers_loop (MoE)", plain)
    print(
        f"litsft finetune_full / transformers loop (MoE): {results['full_over_transformers_loop']:.2f}x tokens/s"
    )
    if args.results_json:
        Path(args.results_json).write_text(json.dumps(results, indent=1))


def main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        sys.exit(
            "error: bench_gpu.py needs a CUDA GPU and found none; on a CPU run benchmarks/bench_throughput.py"
        )
    if args.warmup < 1:
        sys.exit(f"error: --warmup {args.warmup} must be at least 1: litsft logs every --warmup steps")
    if args.warmup >= args.steps:
        sys.exit(
            f"error: --warmup {args.warmup} leaves no measured step of --steps {args.steps}; raise --steps"
        )
    args.work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="litsft-gpu-"))
    os.environ["LITSFT_CACHE_DIR"] = str(args.work_dir / "cache")
    shape = Config.from_name(QWEN3_MOE if args.moe_layers else LLAMA_3_2_1B)
    fields = {name: getattr(shape, name) for name in SHAPE_FIELDS + (MOE_FIELDS if args.moe_layers else ())}
    if args.moe_layers:
        fields["num_layers"] = args.moe_layers
    # The demo tokenizer (449 tokens) with the real vocabulary's embedding rows: the vocabulary's cost is the model's.
    checkpoint = make_checkpoint(args.work_dir / "checkpoint", **fields)
    config = Config.from_checkpoint(checkpoint)
    data = write_mixed_length_data(args.work_dir / "train.json", args.records, max_words=4000)
    print(machine_description(), "|", torch.cuda.get_device_name())
    if args.context_sizes:
        print(f"{num_parameters(config) / 1e9:.2f}B parameters, bf16-mixed, packed rows of {args.max_seq_length}",
              flush=True)  # fmt: skip
        results = context_runs(config, checkpoint, data, args)
        if args.results_json:
            Path(args.results_json).write_text(
                json.dumps(
                    {"device": torch.cuda.get_device_name(), "machine": machine_description(), **results},
                    indent=1,
                )
            )
        return
    print(
        f"{num_parameters(config) / 1e9:.2f}B parameters, 1 GPU, bf16-mixed, packed rows of {args.max_seq_length}, "
        f"micro batch 1, {args.steps} steps ({args.warmup} warm-up left out)",
        flush=True,
    )
    batches = packed_batches(checkpoint, data, args)
    if args.moe_layers:
        moe_runs(config, checkpoint, data, batches, args)
        return
    rank = args.lora_rank
    lora_config = LoRAConfig(rank=rank, alpha=2 * rank)
    adapters = lora_parameters(config, lora_config.target_list, rank)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "machine": machine_description(),
        "bf16_peak_flops": device_peak_flops(torch.device("cuda"), "bf16-mixed"),
        "settings": {name: value for name, value in vars(args).items() if name != "work_dir"},
        "parameters": num_parameters(config),
        "runs": {},
    }

    def record(name: str, result: dict, planned_mib: float | None = None) -> dict:
        if planned_mib is not None:
            result = {
                **result,
                "planned_peak_mib": planned_mib,
                "plan_over_measured": planned_mib / result["peak_mib"],
            }
        results["runs"][name] = result
        print_result(name, result)
        if args.results_json:
            Path(args.results_json).write_text(json.dumps(results, indent=1))
        return result

    litsft_work = step_work(config, batches, "litsft")
    full = record(
        "finetune_full",
        litsft_run("finetune_full", checkpoint, data, args, litsft_work),
        planned_peak_mib(config, args),
    )
    plain = record(
        "transformers_loop", transformers_run(config, batches, args, step_work(config, batches, "plain"))
    )
    results["full_over_transformers_loop"] = full["tokens_per_second"] / plain["tokens_per_second"]
    print(f"litsft finetune_full / transformers loop: {results['full_over_transformers_loop']:.2f}x tokens/s")
    lora_work = step_work(config, batches, "litsft", "lora", adapters)
    lora_options = ("--lora.rank", str(rank), "--lora.alpha", str(2 * rank))
    lora = record(
        f"finetune_lora_r{rank}",
        litsft_run("finetune_lora", checkpoint, data, args, lora_work, *lora_options),
        planned_peak_mib(config, args, lora_config),
    )
    results["lora_over_full"] = lora["tokens_per_second"] / full["tokens_per_second"]
    # The frozen base in bf16 instead of fp32 master weights with gradients and AdamW state: at least 4 bytes
    # of each base parameter that LoRA does not hold in fp32.
    results["full_minus_lora_peak_mib"] = full["peak_mib"] - lora["peak_mib"]
    results["fp32_base_copy_mib"] = num_parameters(config) * 4 / 2**20
    print(
        f"finetune_lora / finetune_full: {results['lora_over_full']:.2f}x tokens/s, peak lower by "
        f"{results['full_minus_lora_peak_mib']:,.0f} MiB (an fp32 copy of the base: {results['fp32_base_copy_mib']:,.0f} MiB)"
    )
    if args.float8 != "none":
        float8 = record(
            f"finetune_full_float8_{args.float8}",
            litsft_run("finetune_full", checkpoint, data, args, litsft_work, "--train.float8", args.float8),
        )
        results["float8_over_full"] = float8["tokens_per_second"] / full["tokens_per_second"]
        results["float8_loss_max_relative_difference"] = loss_difference(float8["losses"], full["losses"])
        print(
            f"finetune_full float8 {args.float8} / bf16: {results['float8_over_full']:.2f}x tokens/s, loss within "
            f"{results['float8_loss_max_relative_difference']:.2%} of bf16's at every logged step"
        )
    if args.results_json:
        Path(args.results_json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max_seq_length", type=int, default=4096)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument(
        "--records", type=int, default=20_000, help="instruction records written (and tokenized)"
    )
    parser.add_argument("--float8", default="tensorwise", choices=("tensorwise", "rowwise", "none"))
    parser.add_argument("--results_json", default=None, help="write every figure here as JSON")
    parser.add_argument(
        "--context_sizes", type=int, nargs="+", default=None,
        help="instead: finetune_full at each --parallel.context size on two GPUs, tokens/s per GPU",
    )  # fmt: skip
    parser.add_argument(
        "--moe_layers", type=int, default=0,
        help="instead: finetune_full and the transformers loop on Qwen3-30B-A3B's shape cut to this many layers",
    )  # fmt: skip
    parser.add_argument("--work_dir", default=None, help="default: a new temporary directory")
    main(parser.parse_args())
