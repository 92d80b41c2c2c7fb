"""LoRA on a pretrained base, measured on the demo: pretrain demo-llama on the demo's plain-text corpus, then
fine-tune LoRA adapters on the demo instructions, and print held-out exact match at each stage.

    python benchmarks/lora_on_pretrained_demo.py --out_dir out/lora-demo [--pretrain_steps 600 --lora_steps 400]

Prints figures, asserts nothing. Two processes (FULL_SHARD) for both stages, as the README's main job.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from litsft.cli.demo import exact_match_accuracy, make_base_checkpoint
from litsft.data import Demo, write_demo_corpus


def run(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run([sys.executable, "-m", "litsft", *args], env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", type=Path, default=Path("out/lora-demo"))
    parser.add_argument("--pretrain_steps", type=int, default=600)
    parser.add_argument("--lora_steps", type=int, default=400)
    args = parser.parse_args()
    out = args.out_dir
    initial = make_base_checkpoint(out / "initial", seed=1337)
    corpus = out / "corpus"
    write_demo_corpus(corpus, num_examples=20_000, num_files=40)
    common = [
        "--devices",
        "2",
        "--precision",
        "32-true",
        "--train.log_interval",
        "50",
        "--eval.max_new_tokens",
        "0",
    ]
    run("pretrain", str(initial), "--tokenizer_dir", str(initial), "--out_dir", str(out / "pretrain"),
        "--data", "TextFiles", "--data.train_data_path", str(corpus), "--train.max_steps", str(args.pretrain_steps),
        "--train.global_batch_size", "16", "--train.micro_batch_size", "8", "--train.max_seq_length", "128",
        "--optimizer.lr", "3e-3", "--optimizer.min_lr", "3e-4", "--optimizer.warmup_steps", "20", *common)  # fmt: skip
    pretrained = out / "pretrain" / "final"
    run("finetune_lora", str(pretrained), "--out_dir", str(out / "lora"), "--data", "Demo",
        "--train.max_steps", str(args.lora_steps), "--train.global_batch_size", "16", "--train.micro_batch_size", "8",
        "--train.max_seq_length", "128", "--lora.rank", "16", "--lora.alpha", "32", "--optimizer.lr", "3e-3",
        "--optimizer.warmup_steps", "20", *common)  # fmt: skip
    run("merge_lora", str(out / "lora" / "final"), "--out_dir", str(out / "merged"))
    data = Demo()
    print(f"held-out exact match, randomly initialized:       {exact_match_accuracy(initial, data):.1%}")
    print(f"held-out exact match, pretrained on the corpus:   {exact_match_accuracy(pretrained, data):.1%}")
    print(
        f"held-out exact match, pretrained + LoRA (merged): {exact_match_accuracy(out / 'merged', data):.1%}"
    )


if __name__ == "__main__":
    main()
