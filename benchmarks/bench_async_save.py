"""How long a training step is blocked by a checkpoint save: synchronous vs `--train.async_save`.

    python benchmarks/bench_async_save.py [--device cpu|cuda] [--hidden 768 --layers 12 --repeats 3]
                                          [--results_json PATH]

One process, the shape of bench_load_memory.py (the largest model the benchmarks use: ~113M parameters,
fp32), AdamW after one step, so each checkpoint holds the parameters and both moments (~1.35 GB). Each repeat
saves a step checkpoint synchronously (`save_training_checkpoint`: the step waits for every byte) and in the
background (`start_background_save`: the step waits for the copy to host memory; then one training step runs
while the files are written, and `wait()` publishes). On a GPU the background save runs twice per repeat:
copying into new ordinary memory (DCP's default) and into the page-locked buffers training uses
(`pinned_stager`, allocated by the first save and reused after: its first copy is reported apart). Prints the
medians: blocked time, time until published, and a training step's time alone and during the background
write. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import machine_description

from litsft.checkpoint.sharded_tensors import pinned_stager
from litsft.checkpoint.training_checkpoint import save_training_checkpoint, start_background_save
from litsft.model.accounting.sizes import num_parameters
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer
from litsft.training.args import OptimizerConfig
from litsft.training.optimizer import build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--results_json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "error: --device cuda needs a CUDA GPU and found none; leave it out to measure on the CPU"
        )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litsft-async-save-"))
    work.mkdir(parents=True, exist_ok=True)
    config = Config.from_name("tiny-llama", vocab_size=32000, hidden_size=args.hidden,
                             intermediate_size=int(args.hidden * 2.75), num_layers=args.layers,
                             num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128)  # fmt: skip
    model = Transformer(config).to(device)
    model.init_weights(0)
    optimizer = build_optimizer(model, OptimizerConfig())
    tokens = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).to(
        device
    )

    def synchronized() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def train_step() -> float:
        start = synchronized()
        model(input_ids=tokens, labels=tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        return synchronized() - start

    step = 0

    def save(background: bool, stager: object = None) -> tuple[float, float, float]:
        """(seconds the step was blocked, seconds until published, the step taken during the write)."""
        nonlocal step
        step += 1
        what = (work, step, model, optimizer, {"recipe": "bench"}, {"loader": {}})
        start = synchronized()
        if not background:
            save_training_checkpoint(*what)
            return time.perf_counter() - start, time.perf_counter() - start, 0.0
        saving = start_background_save(*what, True, None, keep_last=None, stager=stager)
        blocked = time.perf_counter() - start
        during = train_step()
        saving.wait()
        return blocked, time.perf_counter() - start, during

    train_step()  # the optimizer state exists from here on
    kinds: dict[str, Callable[[], tuple[float, float, float]]] = {
        "synchronous": lambda: save(False),
        "background, ordinary memory": lambda: save(True),
    }
    stager = pinned_stager() if device.type == "cuda" else None
    first_pinned = save(True, stager)[0] if stager is not None else None
    if stager is not None:
        kinds["background, page-locked buffers reused"] = lambda: save(True, stager)
    rows: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
    alone: list[float] = []
    state_gb = 3 * num_parameters(config) * 4 / 1e9
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"

    def medians() -> dict[str, list[float]]:
        return {kind: [statistics.median(column) for column in zip(*values)] for kind, values in rows.items()}

    for _ in range(args.repeats):
        alone.append(train_step())
        for kind, run in kinds.items():
            rows[kind].append(run())
            for old in work.glob("step-*"):
                shutil.rmtree(old)
        if args.results_json is not None:  # after every repeat: a run cut short keeps what it measured
            results = {"device": name, "checkpoint_gb": state_gb, "repeats": len(alone),
                       "step_alone_s": statistics.median(alone), "first_page_locked_blocked_s": first_pinned,
                       "saves": {kind: dict(zip(("blocked_s", "published_s", "step_during_write_s"), values))
                                 for kind, values in medians().items()}}  # fmt: skip
            args.results_json.write_text(json.dumps(results, indent=1))
    print(f"# benchmarks/bench_async_save.py on {name}; {machine_description()}")
    print(f"model: {num_parameters(config) / 1e6:.1f}M parameters, fp32, AdamW: a checkpoint of ~{state_gb:.2f} GB;"
          f" 1 process on {args.device}, {torch.get_num_threads()} threads; medians of {args.repeats}")  # fmt: skip
    print(f"{'save':<42}{'step blocked s':>15}{'published after s':>19}{'step during write s':>21}")
    for kind, (blocked, published, during) in medians().items():
        during_text = f"{during:.2f}" if kind != "synchronous" else "-"
        print(f"{kind:<42}{blocked:>15.2f}{published:>19.2f}{during_text:>21}")
    if first_pinned is not None:
        print(f"{'background, page-locked, first (allocates)':<42}{first_pinned:>15.2f}")
    print(f"training step alone: {statistics.median(alone):.2f} s")
    if stager is not None:
        stager.close()


if __name__ == "__main__":
    main()
