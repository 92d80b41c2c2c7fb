"""litsft next to LitGPT 0.5.13: useful (non-padding) tokens per second of full and LoRA fine-tuning.

python benchmarks/bench_vs_litgpt.py [--runs 3] [--threads 1] [--num_samples 800]

Both sides get the same model shape (demo-llama: 4 layers, hidden 128, GQA 4/2, the demo tokenizer's
449-token vocabulary), the same instruction JSON (train.json / val.json, outputs of 2 to 256 words: mixed
lengths), the same alpaca prompt with the prompt masked, the same micro/global batch, 32-true precision,
OMP_NUM_THREADS, no loader workers, one device, one epoch. LoRA is rank 8, alpha 16, dropout 0.05 on every
attention and MLP projection on both sides. LitGPT is installed into its own virtualenv on first use
(`pip install torch==2.13.0` first, so pip keeps the CPU wheel, then litgpt==0.5.13 and requests), and gets a
local checkpoint directory (model_config.yaml, randomly initialized lit_model.pth, the same tokenizer files).
litsft runs from its own virtualenv too, installed the way a user installs it (runtime dependencies only,
editable, so this checkout's code): neither side carries the other's or a test suite's packages.

How each side is measured, the same way:
- time: the wall time of the training loop, evaluation left out. LitGPT prints each iteration's wall time
  ("iter time", from fetching the batch to the loss read after the optimizer step; --train.log_interval 1),
  and their sum is its loop time; its own tok/s is not used (it counts padding and includes validation).
  litsft's loop time is its throughput timer (metrics.csv, one row for the whole run, validation paused):
  input tokens / tokens_per_second.
- useful tokens: the tokens of every sample the epoch trained on (prompt, response, end-of-text), counted
  by each side's own tokenization and batching code before the run: LitGPT's SFTDataset, and the samples in
  litsft's global batches for epoch 0 (it drops an incomplete last global batch). Padding is never counted.
Runs alternate (litsft packed, LitGPT, litsft unpacked) so that load from other users hits all of them;
the ratios printed are medians over the runs of useful tokens/s, litsft / LitGPT.

Whole processes are timed too, start-up, data preparation, validation and saving included, the way a user's
clock runs: litsft's data cache is emptied before each of its runs, so it tokenizes as a first run does.
The first litsft run of each method prints its wall time by phase (`--log.timings`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import bench_env, machine_description, make_checkpoint, median, run_litsft, training_rows

from litsft.model.config import Config

LITGPT_VENV = Path.home() / ".cache" / "litsft-bench" / "litgpt-venv"
LITSFT_VENV = Path.home() / ".cache" / "litsft-bench" / "litsft-venv"
REPOSITORY = Path(__file__).resolve().parents[1]
ITER_TIME = re.compile(r"iter (\d+) step \d+ \|.*iter time: ([\d.]+) ms")


def install_litgpt(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([python, "-c", "import litgpt, requests"]).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # torch first and pinned: anything else makes pip download a CUDA build of several GB.
    subprocess.run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
    (venv / "constraints.txt").write_text("torch==2.13.0\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", venv / "constraints.txt", "litgpt==0.5.13", "requests"],
        check=True,
    )
    return python


def install_litsft(venv: Path) -> Path:
    """A virtualenv with litsft as a user installs it (its runtime dependencies, no test extras), editable so
    that it runs this checkout's code. The development environment also holds transformers and peft for the
    parity tests, and Lightning imports transformers at start-up wherever it is installed (torchmetrics'
    BERTScore checks for it): timing litsft there would charge it for packages a user does not have."""
    python = venv / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        (venv / "constraints.txt").write_text("torch==2.13.0\n")
    installed = subprocess.run(
        [python, "-c", "import litsft, sys; print(litsft.__file__)"], capture_output=True
    )
    if installed.returncode != 0 or str(REPOSITORY) not in installed.stdout.decode():
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "-c", venv / "constraints.txt", "-e", str(REPOSITORY)],
            check=True,
        )
        # As in .ci/install.sh: litdata pulls a CUDA torchvision that breaks `import lightning` on CPU torch.
        if subprocess.run([python, "-c", "import torchvision"], capture_output=True).returncode != 0:
            subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=False)
    return python


def litgpt_checkpoint(python: Path, litsft_dir: Path, directory: Path) -> Path:
    """The same shape and tokenizer in LitGPT's layout, weights drawn by LitGPT's own initialization."""
    config = Config.from_checkpoint(litsft_dir)
    directory.mkdir(parents=True, exist_ok=True)
    model_config = {
        "name": "bench-llama",
        "block_size": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "padded_vocab_size": config.vocab_size,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_embd": config.hidden_size,
        "n_query_groups": config.num_kv_heads,
        "head_size": config.head_dim,
        "rotary_percentage": 1.0,
        "parallel_residual": False,
        "bias": False,
        "norm_class_name": "RMSNorm",
        "norm_eps": config.rms_norm_eps,
        "mlp_class_name": "LLaMAMLP",
        "intermediate_size": config.intermediate_size,
        "rope_base": int(config.rope_theta),
    }
    # YAML reads 1e-05 as a string: floats are written without an exponent.
    values = {k: f"{v:.10f}" if isinstance(v, float) else json.dumps(v) for k, v in model_config.items()}
    (directory / "model_config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in values.items()))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(litsft_dir / name, directory / name)
    script = (
        "import sys, torch; from litgpt import GPT, Config; torch.manual_seed(0); "
        "m = GPT(Config.from_file(sys.argv[1] + '/model_config.yaml')); m.apply(m._init_weights); "
        "torch.save(m.state_dict(), sys.argv[1] + '/lit_model.pth')"
    )
    subprocess.run([python, "-c", script, str(directory)], check=True)
    return directory


def litgpt_useful_tokens(python: Path, checkpoint: Path, data_dir: Path, max_seq_length: int) -> int:
    script = (
        "import sys; from pathlib import Path; from litgpt import Tokenizer; from litgpt.data import JSON; "
        "d = JSON(json_path=Path(sys.argv[2]), mask_prompt=True, num_workers=0); "
        "d.connect(Tokenizer(Path(sys.argv[1])), batch_size=1, max_seq_length=int(sys.argv[3])); d.setup(); "
        "print(sum(len(d.train_dataset[i]['input_ids']) for i in range(len(d.train_dataset))))"
    )
    out = subprocess.run(
        [python, "-c", script, str(checkpoint), str(data_dir), str(max_seq_length)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.split()[-1])


def litsft_useful_tokens(
    checkpoint: Path, data_dir: Path, args: argparse.Namespace, packing: bool
) -> tuple[int, int]:
    """(useful tokens, input tokens) of epoch 0: samples of n tokens give n - 1 input positions."""
    from litsft.data import JSON
    from litsft.data.tokenizer import Tokenizer

    data = JSON(json_path=data_dir, prompt_style="alpaca", packing=packing)
    data.connect(Tokenizer(checkpoint), max_seq_length=args.max_seq_length, seed=1337)
    data.prepare()
    data.setup()
    loader = data.train_dataloader(0, 1, args.micro_batch_size, args.global_batch_size)
    lengths = data.train_samples.lengths
    used = [i for batch in loader.global_batches(0) for row in batch for i in row]
    return int(sum(lengths[i] for i in used)), int(sum(lengths[i] - 1 for i in used))


def time_litsft(
    method: str, checkpoint: Path, data_dir: Path, args: argparse.Namespace, packing: bool, input_tokens: int
) -> tuple[float, float, str]:
    """(training-loop seconds, whole-process seconds, the run's stdout with its phase timings). The data cache
    is emptied first: the process tokenizes, as a first run does (LitGPT tokenizes as it trains)."""
    out_dir = args.work_dir / f"litsft-{method}"
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(args.work_dir / "cache", ignore_errors=True)
    wall, stdout = run_litsft(
        [
            f"finetune_{method}", str(checkpoint), "--out_dir", str(out_dir), "--data", "JSON",
            "--data.json_path", str(data_dir), "--data.prompt_style", "alpaca", "--data.packing", str(packing).lower(),
            "--precision", "32-true", "--train.epochs", "1", "--train.max_seq_length", str(args.max_seq_length),
            "--train.micro_batch_size", str(args.micro_batch_size),
            "--train.global_batch_size", str(args.global_batch_size), "--train.log_interval", "1000000",
            "--eval.max_batches", "1", "--eval.max_new_tokens", "0", "--resume", "false", "--log.timings", "true",
        ],
        args.work_dir, args.threads, python=args.litsft_python,
    )  # fmt: skip
    (row,) = training_rows(out_dir)
    return input_tokens / row["tokens_per_second"], wall, stdout


def time_litgpt(
    python: Path, method: str, checkpoint: Path, data_dir: Path, args: argparse.Namespace
) -> tuple[float, float]:
    """(training-loop seconds, whole-process seconds)."""
    out_dir = args.work_dir / f"litgpt-{method}"
    shutil.rmtree(out_dir, ignore_errors=True)
    lora = (
        ["--lora_key", "true", "--lora_projection", "true", "--lora_mlp", "true"] if method == "lora" else []
    )
    command = [
        str(python), "-m", "litgpt", f"finetune_{method}", str(checkpoint), "--out_dir", str(out_dir),
        "--data", "JSON", "--data.json_path", str(data_dir), "--data.mask_prompt", "true",
        "--data.num_workers", "0", "--precision", "32-true", "--devices", "1", "--train.epochs", "1",
        "--train.max_seq_length", str(args.max_seq_length), "--train.micro_batch_size", str(args.micro_batch_size),
        "--train.global_batch_size", str(args.global_batch_size), "--train.log_interval", "1",
        "--train.lr_warmup_steps", "1", "--train.save_interval", "1000000", "--eval.interval", "1000000",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--eval.max_iters", "1",
        "--logger_name", "csv", *lora,
    ]  # fmt: skip
    env = bench_env(args.work_dir, args.threads)
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=args.work_dir)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"litgpt {method} exited {result.returncode}:\n{result.stderr[-4000:]}")
    iterations = {int(i): float(ms) for i, ms in ITER_TIME.findall(result.stdout + result.stderr)}
    return sum(iterations.values()) / 1000, wall


def per_run(packed: list[float], unpacked: list[float]) -> str:
    """The ratios of each run, packed / unpacked: "(per run: 1.54, 1.55, 1.47 / 1.66, 1.65, 1.60)"."""
    listed = [", ".join(f"{r:.2f}" for r in ratios) for ratios in (packed, unpacked)]
    return f"(per run: {listed[0]} / {listed[1]})"


def main(args: argparse.Namespace) -> None:
    args.work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="litsft-vs-litgpt-"))
    os.environ["LITSFT_CACHE_DIR"] = str(args.work_dir / "cache")
    python = install_litgpt(Path(args.litgpt_venv))
    args.litsft_python = install_litsft(Path(args.litsft_venv))
    checkpoint = make_checkpoint(args.work_dir / "litsft-checkpoint")
    data_dir = args.work_dir / "data"
    data_dir.mkdir(exist_ok=True)
    from harness import write_mixed_length_data

    write_mixed_length_data(data_dir / "train.json", args.num_samples, max_words=400, seed=0)
    write_mixed_length_data(data_dir / "val.json", 8, max_words=400, seed=1)
    litgpt_dir = litgpt_checkpoint(python, checkpoint, args.work_dir / "litgpt-checkpoint")

    litgpt_tokens = litgpt_useful_tokens(python, litgpt_dir, data_dir, args.max_seq_length)
    packed_tokens, packed_inputs = litsft_useful_tokens(checkpoint, data_dir, args, packing=True)
    padded_tokens, padded_inputs = litsft_useful_tokens(checkpoint, data_dir, args, packing=False)
    print(machine_description())
    print(
        f"{args.num_samples} samples, max_seq_length {args.max_seq_length}, micro batch {args.micro_batch_size}, "
        f"global batch {args.global_batch_size}, {args.threads} thread(s), 32-true, 1 device"
    )
    print(
        f"useful tokens per epoch: LitGPT {litgpt_tokens:,}, litsft packed {packed_tokens:,}, "
        f"litsft unpacked {padded_tokens:,}"
    )
    for method in args.methods:
        rates: dict[str, list[float]] = {"packed": [], "litgpt": [], "unpacked": []}
        walls: dict[str, list[float]] = {"packed": [], "litgpt": [], "unpacked": []}
        for run in range(args.runs):
            seconds, wall, stdout = time_litsft(method, checkpoint, data_dir, args, True, packed_inputs)
            rates["packed"].append(packed_tokens / seconds)
            walls["packed"].append(wall)
            if run == 0:
                print(f"finetune_{method}, litsft packed, run 1 (--log.timings):")
                print(stdout[stdout.index("Wall time by phase") :].rstrip(), flush=True)
            seconds, wall = time_litgpt(python, method, litgpt_dir, data_dir, args)
            rates["litgpt"].append(litgpt_tokens / seconds)
            walls["litgpt"].append(wall)
            seconds, wall, _ = time_litsft(method, checkpoint, data_dir, args, False, padded_inputs)
            rates["unpacked"].append(padded_tokens / seconds)
            walls["unpacked"].append(wall)
            print(
                f"finetune_{method} run {run + 1}: useful tokens/s litsft packed {rates['packed'][-1]:,.0f}, "
                f"LitGPT {rates['litgpt'][-1]:,.0f}, litsft unpacked {rates['unpacked'][-1]:,.0f}; whole process "
                f"litsft packed {walls['packed'][-1]:.1f} s, LitGPT {walls['litgpt'][-1]:.1f} s, litsft unpacked "
                f"{walls['unpacked'][-1]:.1f} s",
                flush=True,
            )
        ratios_packed = [p / g for p, g in zip(rates["packed"], rates["litgpt"])]
        ratios_unpacked = [u / g for u, g in zip(rates["unpacked"], rates["litgpt"])]
        print(
            f"finetune_{method} median of {args.runs}: litsft packed {median(rates['packed']):,.0f}, "
            f"LitGPT {median(rates['litgpt']):,.0f}, litsft unpacked {median(rates['unpacked']):,.0f} useful tokens/s; "
            f"ratio litsft/LitGPT packed {median(ratios_packed):.2f}x, unpacked {median(ratios_unpacked):.2f}x "
            f"{per_run(ratios_packed, ratios_unpacked)}"
        )
        wall_packed = [g / p for p, g in zip(walls["packed"], walls["litgpt"])]
        wall_unpacked = [g / u for u, g in zip(walls["unpacked"], walls["litgpt"])]
        print(
            f"finetune_{method} whole process, median of {args.runs}: litsft packed {median(walls['packed']):.1f} s, "
            f"LitGPT {median(walls['litgpt']):.1f} s, litsft unpacked {median(walls['unpacked']):.1f} s; LitGPT's "
            f"time / litsft's packed {median(wall_packed):.2f}x, unpacked {median(wall_unpacked):.2f}x "
            f"{per_run(wall_packed, wall_unpacked)}"
        )
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num_samples", type=int, default=800)
    parser.add_argument("--max_seq_length", type=int, default=512)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--litgpt_venv", default=str(LITGPT_VENV))
    parser.add_argument("--litsft_venv", default=str(LITSFT_VENV))
    parser.add_argument("--work_dir", default=None, help="default: a new temporary directory")
    main(parser.parse_args())
