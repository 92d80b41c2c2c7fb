"""litsft against a plain transformers training loop on one GPU: tokens/s, MFU and peak memory.

python benchmarks/bench_gpu.py [--steps 40] [--warmup 10] [--max_seq_length 4096] [--lora_rank 16]

In one invocation, on a randomly initialized Llama-3.2-1B shape (16 layers, hidden 2048, GQA 32/8, 128k
vocabulary, tied embeddings), bf16-mixed, packed rows of `--max_seq_length` tokens of instruction data of
mixed lengths, micro batch 1:

1. litsft finetune_full through the real engine (`python -m litsft`, compile on: the GPU default);
2. litsft finetune_lora, rank `--lora_rank`, alpha twice the rank, all linear projections;
3. a plain transformers LlamaForCausalLM loop as a user writes it: bf16 autocast over fp32 weights, fused
   AdamW, each decoder layer compiled, sdpa attention (plain causal over the packed row: it does not keep
   documents apart, so it does less attention work than litsft), on the same rows litsft's loader makes.

litsft's figures are its own metrics.csv rows after `--warmup` steps (compilation and allocator warm-up left
out); the transformers loop is timed the same way, with the same token count (non-padding input tokens),
the same FLOPs per token (litsft.metrics.flops_per_token) and the GPU's datasheet bf16 peak. Printed: each
run's tokens/s, MFU and peak allocated memory, then litsft/transformers and lora/full.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
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

from litsft.config import Config
from litsft.metrics import device_peak_flops, flops_per_token
from litsft.sizes import num_parameters

LLAMA_3_2_1B = "Llama-3.2-1B"
SHAPE_FIELDS = (
    "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
    "tie_word_embeddings", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
)  # fmt: skip


def litsft_run(recipe: str, checkpoint: Path, data: Path, args: argparse.Namespace, *extra: str) -> dict:
    out_dir = args.work_dir / recipe
    shutil.rmtree(out_dir, ignore_errors=True)
    run_litsft(
        [
            recipe, str(checkpoint), "--out_dir", str(out_dir), "--data", "JSON", "--data.json_path", str(data),
            "--data.prompt_style", "alpaca", "--devices", "1", "--precision", "bf16-mixed",
            "--train.max_steps", str(args.steps), "--train.max_seq_length", str(args.max_seq_length),
            "--train.micro_batch_size", "1", "--train.global_batch_size", "1", "--train.log_interval", "1",
            "--eval.max_batches", "1", "--eval.max_new_tokens", "0", "--resume", "false", *extra,
        ],
        args.work_dir, threads=8,
    )  # fmt: skip
    rows = training_rows(out_dir)[args.warmup :]
    return {
        "tokens_per_second": median([r["tokens_per_second"] for r in rows]),
        "mfu": median([r.get("mfu", float("nan")) for r in rows]),
        "peak_mib": max(r["peak_gpu_memory_allocated_mib"] for r in rows),
    }


def packed_batches(checkpoint: Path, data: Path, args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """The micro-batches litsft's loader gives finetune_full (same data, seed and packing)."""
    from litsft.data import JSON
    from litsft.tokenizer import Tokenizer

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
    config: Config, batches: list[dict[str, torch.Tensor]], args: argparse.Namespace
) -> dict:
    """The plain loop: LlamaForCausalLM, sdpa, compiled layers, bf16 autocast, fused AdamW."""
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rope_scaling=config.rope_scaling, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).cuda().train()
    for layer in model.model.layers:
        layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    torch.cuda.reset_peak_memory_stats()
    tokens, started = 0, 0.0
    for step, batch in enumerate(batches):
        if step == args.warmup:
            torch.cuda.synchronize()
            tokens, started = 0, time.perf_counter()
        input_ids = batch["input_ids"].cuda(non_blocking=True)
        # litsft's labels are already shifted (label t is the target of input t); transformers shifts itself.
        labels = torch.cat([torch.full_like(batch["labels"][:, :1], -100), batch["labels"][:, :-1]], dim=1)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=input_ids, labels=labels.cuda(non_blocking=True)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int((batch["document_ids"] >= 0).sum())
    torch.cuda.synchronize()
    tokens_per_second = tokens / (time.perf_counter() - started)
    peak = device_peak_flops(torch.device("cuda"), "bf16-mixed")
    flops = flops_per_token(config, args.max_seq_length)
    return {
        "tokens_per_second": tokens_per_second,
        "mfu": flops * tokens_per_second / peak if peak else float("nan"),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
    }


def main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        sys.exit(
            "error: bench_gpu.py needs a CUDA GPU and found none; on a CPU run benchmarks/bench_throughput.py"
        )
    if args.warmup >= args.steps:
        sys.exit(
            f"error: --warmup {args.warmup} leaves no measured step of --steps {args.steps}; raise --steps"
        )
    args.work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="litsft-gpu-"))
    os.environ["LITSFT_CACHE_DIR"] = str(args.work_dir / "cache")
    shape = Config.from_name(LLAMA_3_2_1B)
    # The demo tokenizer (449 tokens) with the real 128k-row embedding: the vocabulary's cost is Llama's.
    checkpoint = make_checkpoint(
        args.work_dir / "checkpoint", **{name: getattr(shape, name) for name in SHAPE_FIELDS}
    )
    config = Config.from_checkpoint(checkpoint)
    data = write_mixed_length_data(args.work_dir / "train.json", 20_000, max_words=4000)
    print(machine_description(), "|", torch.cuda.get_device_name())
    print(
        f"{num_parameters(config) / 1e9:.2f}B parameters, 1 GPU, bf16-mixed, packed rows of {args.max_seq_length}, "
        f"micro batch 1, {args.steps} steps ({args.warmup} warm-up left out)",
        flush=True,
    )
    rank = str(args.lora_rank)
    results = {
        "litsft finetune_full": litsft_run("finetune_full", checkpoint, data, args),
        f"litsft finetune_lora r{rank}": litsft_run(
            "finetune_lora",
            checkpoint,
            data,
            args,
            "--lora.rank",
            rank,
            "--lora.alpha",
            str(2 * args.lora_rank),
        ),
        "transformers loop": transformers_run(config, packed_batches(checkpoint, data, args), args),
    }
    for name, result in results.items():
        print(
            f"{name:28s} {result['tokens_per_second']:>9,.0f} tokens/s  MFU {result['mfu']:6.1%}  "
            f"peak allocated {result['peak_mib']:>8,.0f} MiB"
        )
    full, lora, plain = (r["tokens_per_second"] for r in results.values())
    print(f"litsft finetune_full / transformers loop: {full / plain:.2f}x tokens/s")
    print(f"finetune_lora / finetune_full: {lora / full:.2f}x tokens/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max_seq_length", type=int, default=4096)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--work_dir", default=None, help="default: a new temporary directory")
    main(parser.parse_args())
