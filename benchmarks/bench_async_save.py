"""How long a training step is blocked by a checkpoint save: synchronous vs `--train.async_save`.

    python benchmarks/bench_async_save.py [--hidden 768 --layers 12 --repeats 3]

One process on the CPU, the shape of bench_load_memory.py (the largest model the benchmarks use: ~113M
parameters, fp32), AdamW after one step, so each checkpoint holds the parameters and both moments
(~1.3 GB). Each repeat saves a step checkpoint synchronously (`save_training_checkpoint`: the step waits
for every byte) and in the background (`start_background_save`: the step waits for the copy to host
memory; then one training step runs while the files are written, and `wait()` publishes). Prints the
medians: blocked time, time until published, and a training step's time alone and during the background
write (on a machine with 2 cores the write competes with the step for them). Asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import machine_description

from litsft.checkpoint.training_checkpoint import save_training_checkpoint, start_background_save
from litsft.model.config import Config
from litsft.model.network import Transformer
from litsft.model.sizes import num_parameters
from litsft.training.args import OptimizerConfig
from litsft.training.optimizer import build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work_dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litsft-async-save-"))
    config = Config.from_name("tiny-llama", vocab_size=32000, hidden_size=args.hidden,
                             intermediate_size=int(args.hidden * 2.75), num_layers=args.layers,
                             num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128)  # fmt: skip
    model = Transformer(config)
    model.init_weights(0)
    optimizer = build_optimizer(model, OptimizerConfig())
    tokens = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))

    def train_step() -> float:
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    train_step()  # the optimizer state exists from here on
    rows: dict[str, list[float]] = {name: [] for name in ("sync", "async", "published", "alone", "during")}
    step = 0
    for _ in range(args.repeats):
        rows["alone"].append(train_step())
        step += 1
        start = time.perf_counter()
        save_training_checkpoint(work, step, model, optimizer, {"recipe": "bench"}, {"loader": {}})
        rows["sync"].append(time.perf_counter() - start)
        step += 1
        start = time.perf_counter()
        background = start_background_save(
            work, step, model, optimizer, {"recipe": "bench"}, {"loader": {}}, True, None, keep_last=None
        )
        rows["async"].append(time.perf_counter() - start)
        rows["during"].append(train_step())
        background.wait()
        rows["published"].append(time.perf_counter() - start)
        for old in work.glob("step-*"):
            shutil.rmtree(old)
    median = {name: statistics.median(values) for name, values in rows.items()}
    state_gb = 3 * num_parameters(config) * 4 / 1e9
    print(f"# benchmarks/bench_async_save.py on {machine_description()}")
    print(f"model: {num_parameters(config) / 1e6:.1f}M parameters, fp32, AdamW: a checkpoint of ~{state_gb:.2f} GB;"
          f" 1 process, {torch.get_num_threads()} threads; medians of {args.repeats}")  # fmt: skip
    print(f"step blocked by a synchronous save:   {median['sync']:.2f} s")
    print(f"step blocked by a background save:    {median['async']:.2f} s (copy to host memory)")
    print(f"background save published after:      {median['published']:.2f} s")
    print(f"training step alone / during a write: {median['alone']:.2f} s / {median['during']:.2f} s")


if __name__ == "__main__":
    main()
