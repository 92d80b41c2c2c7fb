"""The engine's promises (litsft/training/engine.py), each checked by an equivalence on runs of the full fine-tuning
recipe (recipes/finetune_full.py): distributed = single-process, resumed = uninterrupted."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from launch import (
    DEADLINE_S,
    TINY_MOE,
    TINY_PHI3,
    litsft,
    litsft_in_process,
    litsft_two_nodes,
    max_difference,
    state_dict,
    stopped_copy,
    write_records,
    write_tiny_checkpoint,
)

from litsft.checkpoint.checkpoint_dirs import step_model_config
from litsft.checkpoint.training_checkpoint import latest_checkpoint
from litsft.model.config import Config


def finetune_args(
    checkpoint: Path, data: Path, out_dir: Path, micro: int, steps: int = 5, *extra: str
) -> list[str]:
    return [
        "finetune_full", str(checkpoint), "--out_dir", str(out_dir),
        "--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0.1",
        "--train.global_batch_size", "4", "--train.micro_batch_size", str(micro),
        "--train.max_steps", str(steps), "--train.max_seq_length", "64",
        "--optimizer.lr", "1e-3", "--optimizer.weight_decay", "0.1", "--optimizer.warmup_steps", "2",
        "--precision", "32-true", "--eval.max_new_tokens", "0", "--accelerator", "cpu", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine")
    write_tiny_checkpoint(root / "base", seed=1)
    write_tiny_checkpoint(root / "base-dropout", seed=1, attention_dropout=0.1)
    write_tiny_checkpoint(root / "base-tiny-gemma2", seed=1, model="tiny-gemma2")
    write_tiny_checkpoint(root / "base-tiny-phi3", seed=1, **TINY_PHI3)
    write_tiny_checkpoint(root / "base-tiny-moe", seed=1, **TINY_MOE)
    write_records(root / "data.json", count=48)
    return root


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma2", "tiny-phi3", "tiny-moe"])
def test_distributed_training_equals_single_process(workspace: Path, model: str, capsys) -> None:
    """Every strategy against one process for Llama; for Gemma 2 (sandwich norms, soft-capping, windows),
    Phi-3 (partial rotary, LongRoPE, a window) and a mixture of experts (experts sharded along the expert
    dimension, the load-balancing loss on), 2-process FULL_SHARD only, to keep the suite short. The
    single-process runs are run in this process; the distributed ones as users launch them."""
    llama = model == "tiny-llama"
    base, data, runs_dir = (
        workspace / ("base" if llama else f"base-{model}"),
        workspace / "data.json",
        workspace / model,
    )
    reference = runs_dir / "single-micro4"
    result = litsft_in_process(finetune_args(base, data, reference, micro=4), workspace, capsys)
    # Soft-capped attention cannot run in the CPU's per-document SDPA: the log names the kernel that runs.
    capped = "Attention: mask, soft-capped attention written out"
    assert (capped if model == "tiny-gemma2" else "Attention: segmented, per-document SDPA") in result.stdout
    runs = {}
    if llama:
        runs["single, micro 2 x accumulation 2"] = runs_dir / "single-micro2"
        single_micro2 = finetune_args(base, data, runs["single, micro 2 x accumulation 2"], micro=2)
        litsft_in_process(single_micro2, workspace, capsys)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") if llama else ("FULL_SHARD",):
        out = runs[f"2 processes {strategy}"] = runs_dir / f"two-{strategy}"
        litsft(
            finetune_args(base, data, out, 2, 5, "--devices", "2", "--fsdp.sharding_strategy", strategy),
            workspace,
        )
    if llama:
        out = runs["2 nodes x 1 device HYBRID_SHARD"] = runs_dir / "two-nodes-hybrid"
        litsft_two_nodes(
            finetune_args(
                base, data, out, 2, 5, "--num_nodes", "2", "--fsdp.sharding_strategy", "HYBRID_SHARD"
            ),
            workspace,
        )
    differences = {name: max_difference(reference / "final", out / "final") for name, out in runs.items()}
    print(differences)
    if model == "tiny-moe":  # the routing is logged beside the loss, by one process and by two
        for out in (reference, runs["2 processes FULL_SHARD"]):
            logged = [row for row in csv.DictReader(open(out / "metrics.csv")) if row["loss"]]
            assert len(logged) == 5
            # The balancing loss is k = 2 for even routing; the busiest expert's load is at least the mean.
            assert all(1.0 < float(row["router_aux_loss"]) < 4.0 for row in logged)
            assert all(float(row["expert_load"]) >= 1.0 for row in logged)
    assert all(difference < 1e-5 for difference in differences.values()), differences
    # Training moved the weights: equality above is not the equality of untouched models.
    assert max_difference(base, reference / "final") > 1e-3


def test_resume_is_exact_with_two_processes_and_dropout(workspace: Path) -> None:
    """Stopped after step 6 of 12 and resumed: bit-identical to the uninterrupted run. The data holds about
    5 optimizer steps per epoch, so both halves cross an epoch boundary."""
    base, data = workspace / "base-dropout", workspace / "data.json"
    args = ["--devices", "2", "--train.save_interval", "6"]
    uninterrupted, resumed = workspace / "uninterrupted", workspace / "resumed"
    litsft(finetune_args(base, data, uninterrupted, 2, 12, *args), workspace)
    stopped_copy(uninterrupted, resumed, last_step=12)
    result = litsft(finetune_args(base, data, resumed, 2, 12, *args), workspace)
    assert "Resumed from" in result.stdout + result.stderr
    a, b = state_dict(uninterrupted / "final"), state_dict(resumed / "final")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    epochs = [row.split(",")[1] for row in (uninterrupted / "metrics.csv").read_text().splitlines()[1:]]
    assert len(set(epochs)) >= 3, "the run should span more than two epochs"


def test_a_mixture_of_experts_resumes_exactly_with_two_processes_and_on_one(workspace: Path, capsys) -> None:
    """Experts sharded along the expert dimension and the routers' Adam states come back from a checkpoint as
    they were: stopped after step 2 of 4 and resumed, bit-identical to the uninterrupted run; resumed by one
    process instead, within 1e-5 of it (one process trains as two do)."""
    base, data = workspace / "base-tiny-moe", workspace / "data.json"
    args = ["--devices", "2", "--train.save_interval", "2"]
    uninterrupted, resumed = workspace / "moe-uninterrupted", workspace / "moe-resumed"
    litsft(finetune_args(base, data, uninterrupted, 2, 4, *args), workspace)
    stopped_copy(uninterrupted, resumed, last_step=4)
    result = litsft(finetune_args(base, data, resumed, 2, 4, *args), workspace)
    assert "Resumed from" in result.stdout + result.stderr
    a, b = state_dict(uninterrupted / "final"), state_dict(resumed / "final")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    # Elastic: the same checkpoint resumed by one process, which reassembles each rank's half of the experts.
    elastic = stopped_copy(resumed, workspace / "moe-elastic", last_step=4)
    one = litsft_in_process(
        finetune_args(base, data, elastic, 2, 4, "--train.save_interval", "2"), workspace, capsys
    )
    assert "(written by 2 processes) on 1" in one.stdout + one.stderr
    assert max_difference(uninterrupted / "final", elastic / "final") < 1e-5


def test_a_mixture_of_experts_trained_with_its_own_load_balancing_weight_resumes(
    workspace: Path, capsys
) -> None:
    """--train.router_aux_loss_coef changes the model the run trains, and the checkpoint records it: a relaunch
    with the same command resumes (it was refused as "written for a different model") and finishes with the
    uninterrupted run's weights; the same checkpoint relaunched without the option is refused, naming it."""
    base, data = workspace / "base-tiny-moe", workspace / "data.json"
    args = ["--train.save_interval", "2", "--train.router_aux_loss_coef", "0.1"]
    uninterrupted, resumed = workspace / "moe-coef-uninterrupted", workspace / "moe-coef-resumed"
    litsft_in_process(finetune_args(base, data, uninterrupted, 2, 4, *args), workspace, capsys)
    recorded = json.loads((uninterrupted / "step-00000002" / "trainer_state.json").read_text())
    assert recorded["config"]["router_aux_loss_coef"] == 0.1 != TINY_MOE["router_aux_loss_coef"]
    stopped_copy(uninterrupted, resumed, last_step=4)
    without = litsft_in_process(finetune_args(base, data, resumed, 2, 4), workspace, capsys, check=False)
    assert without.returncode == 2
    assert (
        "(router_aux_loss_coef=0.1, this run has 0.01); pass --train.router_aux_loss_coef 0.1"
        in without.stderr
    )
    result = litsft_in_process(finetune_args(base, data, resumed, 2, 4, *args), workspace, capsys)
    assert "Resumed from" in result.stdout + result.stderr
    assert max_difference(uninterrupted / "final", resumed / "final") == 0.0
    # final/ records the weight the run trained with, as each step does, so a step opened as a model equals it.
    final_config = Config.from_checkpoint(uninterrupted / "final")
    assert final_config.router_aux_loss_coef == 0.1
    assert step_model_config(uninterrupted / "step-00000002") == final_config


def test_interrupted_checkpoint_is_never_resumed(tmp_path: Path) -> None:
    complete = tmp_path / "step-00000004"
    (complete / "shards").mkdir(parents=True)
    (complete / "shards" / "rank-00000.safetensors").write_bytes(b"x")
    (complete / "trainer_state.json").write_text(json.dumps({"files": ["shards/rank-00000.safetensors"]}))
    # Newer, but each is incomplete in its own way.
    (tmp_path / ".step-00000008.partial").mkdir()
    (tmp_path / "step-00000006").mkdir()  # no trainer_state.json: the writer died before publishing
    lost_file = tmp_path / "step-00000007"
    lost_file.mkdir()
    (lost_file / "trainer_state.json").write_text(json.dumps({"files": ["shards/rank-00000.safetensors"]}))
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "trainer_state.json").write_text("{truncated")
    assert latest_checkpoint(tmp_path) == complete


@pytest.mark.parametrize("poisoned", [False, True])
def test_a_non_finite_gradient_skips_the_update_without_a_host_sync_and_stops_the_run(poisoned: bool) -> None:
    """train_step never reads the gradient norm on the host: fused AdamW skips an inf/NaN step on the device
    (found_inf), and the loop's next synchronization stops the run with one line."""
    import torch
    from lightning.fabric import Fabric

    from litsft.errors import LitsftError
    from litsft.model.config import Config
    from litsft.model.network.transformer import Transformer
    from litsft.training.args import OptimizerConfig
    from litsft.training.optimizer import build_optimizer
    from litsft.training.step import raise_if_diverged, train_step

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = Transformer(Config.from_name("tiny-llama"))
    model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-2)))
    input_ids = torch.randint(0, 512, (2, 16))
    if poisoned:  # a broken embedding row: NaN activations, NaN gradients
        with torch.no_grad():
            model.module.embed.weight[input_ids[0, 0]] = float("nan")
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    batch = {"input_ids": input_ids, "labels": torch.randint(0, 512, (2, 16))}
    _, grad_norm, _, _ = train_step(fabric, model, optimizer, [batch], max_norm=1.0)
    assert bool(torch.isfinite(grad_norm)) is not poisoned
    for name, param in model.named_parameters():
        unchanged = torch.equal(param.nan_to_num(), before[name].nan_to_num())
        assert unchanged is poisoned, name
    steps = [float(state["step"]) for state in optimizer.state.values()]
    assert steps == [0.0 if poisoned else 1.0] * len(steps)  # a skipped step does not count for Adam
    if poisoned:
        with pytest.raises(LitsftError, match="inf or NaN in 1 of the first 1 steps"):
            raise_if_diverged(~torch.isfinite(grad_norm), step=1)
    else:
        raise_if_diverged(~torch.isfinite(grad_norm), step=1)


def test_every_validation_pass_scores_the_same_batches(tmp_path: Path) -> None:
    """Passes on unchanged weights give the same val_loss, whether a pass stops at --eval.max_batches or
    uses up the loader: each pass starts from the first validation batch."""
    from types import SimpleNamespace

    from lightning.fabric import Fabric

    from litsft.data import JSON
    from litsft.data.tokenizer import Tokenizer
    from litsft.model.config import Config
    from litsft.model.network.transformer import Transformer
    from litsft.training.evaluation import validate

    base = write_tiny_checkpoint(tmp_path / "base", seed=1)
    records = write_records(tmp_path / "data.json", count=40)
    data = JSON(json_path=records, val_split_fraction=0.25, packing=False, cache_dir=tmp_path / "cache")
    data.connect(Tokenizer(base), max_seq_length=64, seed=0)
    data.prepare()
    data.setup()
    val_loader = data.val_dataloader(rank=0, world_size=1, micro_batch_size=2)
    assert len(val_loader) >= 3
    model = Transformer(Config.from_checkpoint(base))
    model.init_weights(1)
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    first_scores = []
    for max_batches in (2, None):
        scores: list[tuple[float, int]] = []

        def record(
            step: int, loss: float, tokens: int, sample: str | None, objective_means=None, scores=scores
        ) -> None:
            scores.append((loss, tokens))

        run = SimpleNamespace(eval=SimpleNamespace(max_batches=max_batches, max_new_tokens=0), data=data)
        for step in range(3):
            validate(fabric, model, val_loader, None, run, SimpleNamespace(validation_done=record), step)
        assert len(scores) == 3 and scores[0][1] > 0, (max_batches, scores)
        assert scores[0] == scores[1] == scores[2], (max_batches, scores)
        first_scores.append(scores[0])
    # Two batches and the whole set score different tokens: passes that drifted would show.
    assert first_scores[0][1] < first_scores[1][1]


def test_validation_runs_at_every_interval_and_at_the_end(workspace: Path, capsys) -> None:
    """metrics.csv (and loss.png, drawn from the same rows) holds a validation at each --eval.interval and
    at the last step, also when the last step is not on an interval."""
    base, data = workspace / "base", workspace / "data.json"
    for steps, expected in ((6, [2, 4, 6]), (5, [2, 4, 5])):
        out = workspace / f"validation-{steps}"
        extra = ("--eval.interval", "2", "--eval.max_batches", "1", "--eval.max_new_tokens", "3")
        litsft_in_process(finetune_args(base, data, out, 2, steps, *extra), workspace, capsys)
        rows = list(csv.DictReader((out / "metrics.csv").open()))
        assert [int(row["step"]) for row in rows if row["val_loss"]] == expected
        assert all(float(row["val_tokens"]) > 0 for row in rows if row["val_loss"])
        # Beside the metrics, a sample from the first validation prompt at each validation (JSON data).
        samples = (out / "samples.txt").read_text().split("## step ")[1:]
        assert [int(sample.split("\n")[0]) for sample in samples] == expected
        assert all(
            "<|im_start|>user\n" in sample and "<|im_start|>assistant\n" in sample for sample in samples
        )


def test_a_run_prints_each_notice_once_and_no_python_warnings(workspace: Path) -> None:
    """Two processes on a CPU mesh, samples dropped by truncation, a validation at the last step: the log
    holds the dropped-samples notice once as a plain line, the finished progress bar once, the lines saying
    the other rank waits for the data and what was prepared once each, the phase timings
    once, and no Python warning (the DTensor CPU-mesh one came once per rank, the notice with its source line)."""
    import subprocess
    import sys

    from launch import free_port, test_env

    out = workspace / "quiet"
    env = test_env(workspace)
    del env["PYTHONWARNINGS"]  # the run's own warnings filters are what is tested
    env["MASTER_PORT"] = str(free_port())
    # max_seq_length 64 leaves some records of the workspace's data without an assistant token.
    args = finetune_args(workspace / "base", workspace / "data.json", out, 1, 4, "--devices", "2",
                         "--eval.interval", "2", "--log.timings", "true")  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "litsft", *args], env=env, capture_output=True, text=True,
                            timeout=DEADLINE_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "Warning" not in log and "warn(" not in log, log
    assert (
        len(re.findall(r"^Dropped \d+ of \d+ training samples: no assistant token is left", log, re.M)) == 1
    )
    assert result.stderr.count(" 4/4 [") == 1, result.stderr
    # Rank 0 prepares the data (or finds the cache the workspace's other runs wrote) and says once that the
    # other rank waits.
    assert result.stdout.count("Rank 0 prepares the data; the other 1 ranks wait for it") == 1
    prepared = r"^Prepared the train data: .*; (tokenized in [\d.]+ s|read from the cache)$"
    assert len(re.findall(prepared, result.stdout, re.M)) == 1
    assert result.stdout.count("step 4: val_loss") == 1
    # --log.timings: one report, from rank 0, its phases in order and adding up to its total.
    assert result.stdout.count("Wall time by phase") == 1
    report = result.stdout[result.stdout.index("Wall time by phase") :].splitlines()
    total = float(re.search(r"([\d.]+) s in all", report[0]).group(1))
    phases = [
        re.fullmatch(r"  (.+?)\s+([\d.]+) s\s+[\d.]+%\s+[\d,]+ MiB peak RSS", line).groups()
        for line in report[1:12]
    ]
    assert [name.split(":")[0] for name, _ in phases] == [
        "start-up", "checks before launch", "importing torch, Lightning and the model code",
        "Fabric and its processes started", "data", "model", "optimizer, resume, metrics",
        "training loop (with its validations and checkpoints)", "final validation", "final model saved",
        "metrics closed, loss curve drawn",
    ]  # fmt: skip
    assert sum(float(seconds) for _, seconds in phases) == pytest.approx(total, abs=0.1)
