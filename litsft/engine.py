"""The training engine shared by every recipe: Fabric, sharding, the loop, evaluation, checkpoints, resume.

A recipe describes only what differs (`Recipe`: how to build the model, how to fill its weights, what to
save at the end); `fit` does the rest. The loop says what happens each step; `litsft.parallel`,
`litsft.checkpoint`, `litsft.optimizer` and `litsft.metrics` say how.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric import Fabric
from safetensors import SafetensorError
from torch import nn

from litsft import checkpoint, processes
from litsft.args import RunConfig, TrainConfig, accumulation_steps, describe, with_defaults
from litsft.config import Config
from litsft.devices import choose_accelerator, gpu_count
from litsft.errors import LitsftError
from litsft.faults import fault_point
from litsft.model import loss_positions_of
from litsft.optimizer import build_optimizer, learning_rate
from litsft.parallel import build_fabric, default_precision
from litsft.preemption import PREEMPTED_EXIT_CODE, PreemptionFlag
from litsft.run_lock import RunLock
from litsft.validation import FINAL_DIR, check_run


@dataclass
class Recipe:
    """What distinguishes one recipe from another."""

    name: str
    build_model: Callable[[Config], nn.Module]
    """Build the model (called on the meta device) with requires_grad set on what is trained."""
    initialize: Callable[[nn.Module], None]
    """Fill the materialized (possibly sharded) model: load a checkpoint or draw fresh weights."""
    save_final: Callable[[nn.Module, Path], None]
    """Write the final model to the given directory (collective: every rank calls it)."""
    checkpoint_frozen: bool = True
    """Whether step checkpoints hold frozen parameters too (LoRA: no, the base is loaded again)."""
    trainable: Literal["all", "lora"] = "all"
    """What is trained; decides the FLOPs per token behind MFU."""


def launch(recipe: Recipe, run: RunConfig) -> None:
    """Validate the run, take the out_dir lock, start the processes and train. Every check that can fail
    fails here, before any process is spawned or anything in out_dir changes.

    Every process of the run passes through here: Fabric's launcher (which becomes rank 0 and spawns the
    node's other ranks, which run the same command), or each rank that torchrun or srun started."""
    PreemptionFlag.install()  # first: a SIGTERM during setup must stop the run at a step, not kill it
    accelerator = choose_accelerator(run.accelerator, gpu_count())
    run = with_defaults(dataclasses.replace(run, accelerator=accelerator), default_precision(accelerator))
    check_run(run, recipe.name)
    accumulation_steps(run.train, run.world_size)
    if run.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts; ranks inherit it
    spawned = processes.is_spawned_rank()
    with RunLock(run.out_dir) if processes.is_first_process() else nullcontext():
        fabric = build_fabric(run.devices, run.num_nodes, run.precision, run.fsdp, run.accelerator)
        if processes.will_spawn(fabric):
            os.environ[processes.LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            fabric.launch(fit, recipe, run)
        except SystemExit as stop:
            if stop.code != PREEMPTED_EXIT_CODE:
                processes.kill(processes.spawned_processes(fabric))
                raise
            if spawned:
                # The launcher reports the stop; a non-zero exit here would make Fabric's child observer
                # SIGKILL the launcher before it reports.
                raise SystemExit(0) from None
            processes.wait_for(processes.spawned_processes(fabric), timeout_s=60)
            raise
        except BaseException:
            processes.kill(processes.spawned_processes(fabric))
            raise
        finally:
            if os.environ.get(processes.LAUNCHER_PID_ENV) == str(os.getpid()):
                del os.environ[processes.LAUNCHER_PID_ENV]


def fit(fabric: Fabric, recipe: Recipe, run: RunConfig) -> None:
    from litsft.metrics import MetricsLogger
    from litsft.tokenizer import Tokenizer

    out_dir, train = run.out_dir, run.train
    if train.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    fabric.seed_everything(run.seed)
    if fabric.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_partial_checkpoints(out_dir)
    tokenizer = Tokenizer(run.tokenizer_dir)
    run.data.connect(tokenizer, max_seq_length=train.max_seq_length, seed=run.seed)
    if fabric.is_global_zero:
        run.data.prepare()
    fabric.barrier()
    run.data.setup()
    accumulation = accumulation_steps(train, fabric.world_size)
    train_loader = run.data.train_dataloader(
        rank=fabric.global_rank,
        world_size=fabric.world_size,
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size,
    )
    val_loader = run.data.val_dataloader(
        rank=fabric.global_rank, world_size=fabric.world_size, micro_batch_size=train.micro_batch_size
    )
    total_steps = total_optimizer_steps(train, train_loader, accumulation)

    model = setup_model(fabric, recipe, run)
    optimizer = fabric.setup_optimizers(build_optimizer(model, run.optimizer))
    step, epoch = 0, 0
    resume_from = checkpoint.resume_checkpoint(run.resume, out_dir)
    if resume_from is not None:
        step, epoch = resume(
            fabric, resume_from, model.module, optimizer, train_loader, run.seed, recipe.checkpoint_frozen
        )
        fault_point("resumed", fabric.global_rank)
    else:
        train_loader.set_epoch(0)

    metrics = MetricsLogger(
        out_dir,
        loggers=run.log.loggers,
        is_global_zero=fabric.is_global_zero,
        total_steps=total_steps,
        start_step=step,
        run_config=describe(run.cli_arguments),
    )
    metrics.set_model(
        run.config,
        world_size=fabric.world_size,
        device=fabric.device,
        precision=run.precision,
        seq_len=train.max_seq_length,
        trainable=recipe.trainable,
    )
    with metrics:
        train_loop(
            fabric,
            recipe,
            run,
            model,
            optimizer,
            train_loader,
            val_loader,
            tokenizer,
            metrics,
            step,
            epoch,
            total_steps,
            accumulation,
        )
        fault_point("before_final", fabric.global_rank)
        with metrics.paused():
            validate(fabric, model, val_loader, tokenizer, run, metrics, total_steps)
            save_final(fabric, recipe, model.module, out_dir)
    fabric.print(f"Saved the final model to {out_dir / FINAL_DIR}")


def save_final(fabric: Fabric, recipe: Recipe, model: nn.Module, out_dir: Path) -> None:
    """Write the final model under a temporary name and publish it with one rename: a final/ directory
    always holds a complete model, and a relaunch never trains again over it."""
    final, partial = out_dir / FINAL_DIR, out_dir / f".{FINAL_DIR}.partial"
    if fabric.is_global_zero and partial.exists():
        shutil.rmtree(partial)
    fabric.barrier()
    try:
        recipe.save_final(model, partial)
    except (OSError, SafetensorError) as err:
        raise LitsftError(
            f"could not write the final model to {final} ({err}); free disk space or fix permissions, then "
            "relaunch the same command: it resumes from the last checkpoint"
        ) from None
    fabric.barrier()
    fault_point("final_before_rename", fabric.global_rank)
    if fabric.is_global_zero:
        os.replace(partial, final)
    fabric.barrier()


def train_loop(
    fabric: Fabric,
    recipe: Recipe,
    run: RunConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: Any,
    val_loader: Any,
    tokenizer: Any,
    metrics: Any,
    step: int,
    epoch: int,
    total_steps: int,
    accumulation: int,
) -> None:
    preemption = PreemptionFlag.install()
    skipped_steps = torch.zeros((), device=fabric.device)
    batches = iter(train_loader)
    while step < total_steps:
        micro_batches, epoch, batches = next_micro_batches(batches, train_loader, epoch, accumulation)
        if micro_batches is None:
            raise LitsftError(
                "the training data cannot fill one optimizer step; lower --train.global_batch_size"
            )
        lr = learning_rate(run.optimizer, step, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, grad_norm, target_tokens, input_tokens = train_step(
            fabric, model, optimizer, micro_batches, run.train.max_norm
        )
        step += 1
        skipped_steps += ~torch.isfinite(grad_norm)
        fault_point(f"after_step_{step}", fabric.global_rank)
        log = step % run.train.log_interval == 0 or step == total_steps
        evaluate = run.eval.interval and step % run.eval.interval == 0 and step < total_steps
        save = run.train.save_interval and step % run.train.save_interval == 0
        must_stop = preemption.is_set(fabric)
        if log or evaluate or save or must_stop:  # steps that wait for the device anyway
            raise_if_diverged(skipped_steps, step)
        metrics.step_done(
            step,
            epoch=epoch,
            loss=loss,
            learning_rate=lr,
            grad_norm=grad_norm,
            target_tokens=target_tokens,
            input_tokens=input_tokens,
            log=log,
        )
        with metrics.paused():
            if evaluate:
                validate(fabric, model, val_loader, tokenizer, run, metrics, step)
            if save or must_stop:
                save_checkpoint(
                    fabric, run.out_dir, step, epoch, model.module, optimizer, train_loader, run, recipe
                )
        if must_stop:
            fabric.print(f"Stopped by a signal after step {step}; relaunch the same command to resume.")
            raise SystemExit(PREEMPTED_EXIT_CODE)


# ---- setup ----------------------------------------------------------------------------------------------
def setup_model(fabric: Fabric, recipe: Recipe, run: RunConfig) -> nn.Module:
    """Build on the meta device, shard, materialize, then fill: no rank ever holds a full copy it does not need."""
    with torch.device("meta"):
        model = recipe.build_model(run.config)
    model.activation_checkpointing = run.fsdp.activation_checkpointing
    if run.train.compile:
        for block in model.blocks:
            block.compile()  # in place: parameter names do not change
    if fabric.world_size == 1:
        model.to_empty(device=fabric.device)
        model.tie_weights()
    model = fabric.setup_module(model)
    # Recipes, checkpoints and exports see the model itself, with its own parameter names.
    recipe.initialize(model.module)
    fabric.print(trainable_memory_report(model.module, run.config))
    return model


def trainable_memory_report(model: nn.Module, config: Config) -> str:
    """One line comparing what training holds for the trained parameters (fp32 weights, gradients and
    AdamW's two moments: 16 bytes each) with what full fine-tuning of the same model would hold."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    full = config.num_parameters
    mib = 16 / 2**20
    return (
        f"Trainable parameters: {trainable:,} of {full:,}; params+grads+AdamW state {trainable * mib:,.1f} MiB "
        f"vs {full * mib:,.1f} MiB for full fine-tuning ({trainable / full:.2%}), before sharding"
    )


def total_optimizer_steps(train: TrainConfig, loader: Any, accumulation: int) -> int:
    if train.max_steps is not None:
        return train.max_steps
    try:
        micro_batches_per_epoch = len(loader)
    except TypeError:
        raise LitsftError("the data has no known length (streaming); pass --train.max_steps") from None
    steps_per_epoch = micro_batches_per_epoch // accumulation
    if steps_per_epoch == 0:
        raise LitsftError(
            f"one epoch gives {micro_batches_per_epoch} micro-batches per process, fewer than the "
            f"{accumulation} one optimizer step needs; lower --train.global_batch_size"
        )
    return steps_per_epoch * train.epochs


# ---- the loop's parts ---------------------------------------------------------------------------------------
def next_micro_batches(
    batches: Iterator, loader: Any, epoch: int, accumulation: int
) -> tuple[list[dict[str, torch.Tensor]] | None, int, Iterator]:
    """The next `accumulation` micro-batches, moving to the next epoch when this one cannot fill a step."""
    for _ in range(2):
        micro_batches = []
        for batch in batches:
            micro_batches.append(batch)
            if len(micro_batches) == accumulation:
                return micro_batches, epoch, batches
        epoch += 1
        loader.set_epoch(epoch)
        batches = iter(loader)
    return None, epoch, batches


def train_step(
    fabric: Fabric,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, torch.Tensor]],
    max_norm: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over the micro-batches of this rank. Returns (mean loss, grad norm, target tokens,
    non-padding input tokens), all global and still on the device: nothing here makes the host wait for it."""
    device = fabric.device
    inputs = [to_device(mb, device) for mb in micro_batches]
    counts = torch.tensor(
        [
            sum(batch["loss_positions"].numel() for batch in inputs),
            sum(int(_input_token_count(mb)) for mb in micro_batches),
        ],
        device=device,
    )
    counts = fabric.all_reduce(counts, reduce_op="sum")
    target_tokens = counts[0].clamp(min=1)
    # Each rank's summed loss is divided by the *global* target-token count, so every token weighs the same
    # whatever the packing, micro-batch size or number of ranks. FSDP averages gradients over ranks, which
    # the factor world_size undoes.
    scale = fabric.world_size / target_tokens
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(inputs):
        with fabric.no_backward_sync(model, enabled=i < len(inputs) - 1):
            loss = model(**batch)
            fabric.backward(loss * scale)
        loss_sum += loss.detach()
    grad_norm = clip_gradients(model, max_norm)
    # Checked on the device, not read by the host: with `found_inf` set (the flag torch's GradScaler uses),
    # fused AdamW leaves parameters, moments and step count alone when the norm is inf or NaN. The loop
    # reports it at its next synchronization (`raise_if_diverged`).
    # Fabric's wrapper hands step() to the optimizer it wraps, which is where AdamW looks for the flag.
    getattr(optimizer, "optimizer", optimizer).found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = fabric.all_reduce(loss_sum, reduce_op="sum") / target_tokens
    return loss, grad_norm, counts[0], counts[1]


def raise_if_diverged(skipped_steps: torch.Tensor, step: int) -> None:
    """Stop with one line if any optimizer step so far had an inf or NaN gradient norm (and was skipped)."""
    skipped = int(skipped_steps.item())
    if skipped:
        raise LitsftError(
            f"the gradient norm was inf or NaN in {skipped} of the first {step} steps (their updates were "
            "skipped): training diverged or the data holds a broken sample; lower --optimizer.lr, check the "
            "data, or resume from an earlier checkpoint"
        )


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The model's inputs of a CPU micro-batch, on `device`, with the flat indices of the labels that carry a
    loss: found here on the CPU, so the model can skip the output head elsewhere without waiting for the device."""
    names = ("input_ids", "position_ids", "document_ids", "labels")
    inputs = {name: batch[name] for name in names if name in batch}
    inputs["loss_positions"] = loss_positions_of(batch["labels"])
    return {name: tensor.to(device, non_blocking=True) for name, tensor in inputs.items()}


def _input_token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "document_ids" in batch:
        return (batch["document_ids"] >= 0).sum()
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel())


def clip_gradients(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global gradient norm over all ranks (clipped to max_norm when given)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else math.inf, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@torch.no_grad()
def validate(
    fabric: Fabric, model: nn.Module, val_loader: Any, tokenizer: Any, run: RunConfig, metrics: Any, step: int
) -> None:
    if val_loader is None:
        return
    model.eval()
    # From the first batch on every pass: the loader would otherwise go on where the last pass stopped, and
    # passes would score different batches (or none once it is used up).
    val_loader.set_epoch(0)
    totals = torch.zeros(2, device=fabric.device)
    for i, batch in enumerate(val_loader):
        if run.eval.max_batches is not None and i >= run.eval.max_batches:
            break
        batch = to_device(batch, fabric.device)
        totals[0] += model(**batch)
        totals[1] += batch["loss_positions"].numel()
    totals = fabric.all_reduce(totals, reduce_op="sum")
    sample = generate_sample(model, tokenizer, run)
    model.train()
    if totals[1] > 0:
        metrics.validation_done(
            step, loss=(totals[0] / totals[1]).item(), tokens=int(totals[1].item()), sample=sample
        )


def generate_sample(model: nn.Module, tokenizer: Any, run: RunConfig) -> str | None:
    """Greedy completion of the first held-out prompt (data modules with `eval_prompts`, e.g. Demo).
    Every rank generates it: forwards of a sharded model are collective."""
    if run.eval.max_new_tokens <= 0 or not hasattr(run.data, "eval_prompts"):
        return None
    prompts = run.data.eval_prompts()
    if not prompts:
        return None
    from litsft.generate import generate_batch

    messages, _ = prompts[0]
    prompt_ids = run.data.chat_format.encode_prompt(messages)
    completion = generate_batch(
        model, [prompt_ids], max_new_tokens=run.eval.max_new_tokens, stop_ids=tokenizer.stop_ids
    )[0]
    return f"{run.data.render_prompt(messages)}{tokenizer.decode(completion)}"


# ---- checkpoints and resume ----------------------------------------------------------------------------
def save_checkpoint(
    fabric: Fabric,
    out_dir: Path,
    step: int,
    epoch: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    run: RunConfig,
    recipe: Recipe,
) -> None:
    trainer_state = {
        "epoch": epoch,
        "recipe": recipe.name,
        "seed": run.seed,
        "config": asdict(run.config),
        "arguments": describe(run.cli_arguments),
    }
    rank_state = {"rng": checkpoint.rng_state(), "loader": loader.state_dict(), "epoch": epoch}
    checkpoint.save_training_checkpoint(
        out_dir, step, model, optimizer, trainer_state, rank_state, save_frozen=recipe.checkpoint_frozen
    )
    fault_point(f"save_{step}_after_rename", fabric.global_rank)
    checkpoint.rotate_checkpoints(out_dir, run.train.keep_last)
    fabric.print(f"Saved checkpoint {out_dir / checkpoint.checkpoint_name(step)}")


def resume(
    fabric: Fabric,
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    seed: int,
    checkpoint_frozen: bool,
) -> tuple[int, int]:
    state, rank_state = checkpoint.load_training_checkpoint(
        path, model, optimizer, load_frozen=checkpoint_frozen
    )
    step = state["step"]
    if rank_state is None:
        # A different number of ranks: weights and optimizer state were resharded; data order does not depend
        # on the world size; only the per-rank random streams (dropout) cannot continue, so they are reseeded.
        fabric.print(
            f"Resuming {path} (written by {state['world_size']} processes) on {fabric.world_size}: "
            "random streams are reseeded, so dropout differs from an uninterrupted run."
        )
        rank_state = checkpoint.load_rank_zero_state(path)
        torch.manual_seed(seed + step * 7919 + fabric.global_rank)
    else:
        checkpoint.set_rng_state(rank_state["rng"])
    loader.set_epoch(rank_state["epoch"])
    loader.load_state_dict(rank_state["loader"])
    fabric.print(f"Resumed from {path} at step {step}")
    return step, rank_state["epoch"]
