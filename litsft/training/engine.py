"""The training engine shared by every recipe: `fit` sets a run up and `train_loop` trains it.

A recipe describes only what differs (`litsft.training.recipe.Recipe`: how to build the model, how to fill its
weights, what to save at the end). The loop says what happens each step; the components say how: `litsft.training.step` (one
optimizer step), `litsft.training.evaluation` (validation), `litsft.training.checkpointer` (the train state, saved and
restored), `litsft.training.metrics` (logging), `litsft.training.parallel` (sharding), `litsft.runtime.preemption` (signals),
`litsft.training.profiling` (the steps `--log.profile_steps` names).
Processes, the out_dir lock and exit codes are `litsft.cli.launcher`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from litsft.checkpoint import training_checkpoint as checkpoint
from litsft.checkpoint.checkpoint_dirs import (
    FINAL_DIR,
    resume_checkpoint,
    set_aside_damaged_checkpoints,
)
from litsft.checkpoint.model_folder import write_validation_prompts
from litsft.data.step_geometry import StepGeometry
from litsft.errors import LitsftError
from litsft.huggingface.export_check import CHECK_PROMPT_TOKENS
from litsft.model.accounting.sizes import num_parameters
from litsft.model.config import Config
from litsft.model.network.attention import choose_kernel, describe_kernel
from litsft.model.network.context_parallel import ContextShard
from litsft.model.network.moe import reset_balancing_biases
from litsft.model.precision.float8 import precompute_float8_scales
from litsft.model.precision.quantization import is_nf4, stored_bytes
from litsft.runtime.faults import fault_point
from litsft.runtime.files import publish_atomically
from litsft.runtime.preemption import PREEMPTED_EXIT_CODE, PreemptionFlag
from litsft.runtime.timings import run_timer
from litsft.training.args import (
    RunConfig,
    TrainConfig,
    describe,
    on_cuda_by_default,
    profiled_steps,
    step_geometry,
)
from litsft.training.checkpointer import Checkpointer, TrainState
from litsft.training.eval_tasks import TrainingTasks
from litsft.training.evaluation import validate
from litsft.training.objectives import Objective, objective_named
from litsft.training.optimizer import build_optimizer, learning_rate, set_learning_rate
from litsft.training.parallel import context_shard, parallelize
from litsft.training.profiling import PROFILE_DIR, StepProfiler
from litsft.training.recipe import Recipe
from litsft.training.step import (
    RoutingTally,
    diverged,
    loss_scaler,
    next_micro_batches,
    raise_if_diverged,
    train_step,
)


def fit(fabric: Fabric, recipe: Recipe, run: RunConfig) -> None:
    """Set the run up on this rank (data, model, optimizer, resume, metrics), train, validate, save."""
    from litsft.data.tokenizer import Tokenizer
    from litsft.training.metrics import MetricsLogger

    run_timer.mark("Fabric and its processes started")
    out_dir = run.out_dir
    if run.train.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    fabric.seed_everything(run.seed)
    if fabric.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_partial_checkpoints(out_dir)
        set_aside_damaged(fabric, run.resume, out_dir)
    layout = run.layout
    context = context_shard(layout, fabric.global_rank, fabric.device.type)
    fabric.print(f"Parallel layout: {layout.describe()}")
    tokenizer = Tokenizer(run.tokenizer_dir)
    train_loader, val_loader = setup_data(fabric, run, tokenizer)
    total_steps = total_optimizer_steps(
        run.train, train_loader, step_geometry(run.train, layout.data_replicas)
    )
    run_timer.mark("data: tokenized (or read from the cache), loaders")
    model = setup_model(fabric, recipe, run)
    run_timer.mark("model: built, weights loaded, sharded")
    optimizer = fabric.setup_optimizers(build_optimizer(model, run.optimizer, recipe.lr_scale))
    state = TrainState(
        model,
        optimizer,
        train_loader,
        skipped_steps=torch.zeros((), device=fabric.device),
        loss_scaler=loss_scaler(fabric),
    )
    checkpointer = Checkpointer(
        fabric,
        run,
        recipe.name,
        save_frozen=recipe.checkpoint_frozen,
        frozen_base=recipe.frozen_base,
        validation_prompts=check_prompts_of(run.data),
    )
    objective = objective_named(run.objective.name, **run.objective.options())
    if objective.reference_pass:  # scored by the starting weights, before a checkpoint's are loaded
        from litsft.training.reference import attach_reference

        attach_reference(fabric, model, run, {"train": train_loader, "val": val_loader})
        run_timer.mark("reference log-probabilities")
    resume_from = resume_checkpoint(run.resume, out_dir)
    if resume_from is not None:
        checkpointer.load(resume_from, state)
        fault_point("resumed", fabric.global_rank)
    else:
        train_loader.set_epoch(0)

    metrics = MetricsLogger(
        out_dir,
        loggers=run.log.loggers,
        is_global_zero=fabric.is_global_zero,
        total_steps=total_steps,
        start_step=state.step,
        run_config=describe(run.cli_arguments),
    )
    metrics.set_model(
        run.config,
        world_size=fabric.world_size,
        context=layout.context,
        device=fabric.device,
        precision=run.precision,
        trainable=recipe.trainable,
        adapter_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        extra_forward_passes=objective.extra_forward_passes,
    )
    tasks = TrainingTasks(run.eval, tokenizer, str(out_dir)) if run.eval.tasks else None
    evaluate = functools.partial(
        validate,
        fabric,
        model,
        val_loader,
        tokenizer,
        run,
        metrics,
        context=context,
        objective=objective,
        tasks=tasks,
    )
    run_timer.mark("optimizer, resume, metrics")
    with metrics:
        train_loop(fabric, run, state, metrics, checkpointer, evaluate, context, objective)
        checkpointer.close()
        run_timer.mark("training loop (with its validations and checkpoints)")
        fault_point("before_final", fabric.global_rank)
        with metrics.paused():
            evaluate(total_steps)
            run_timer.mark("final validation")
            save_final(fabric, recipe, model.module, out_dir, checkpointer.validation_prompts)
            run_timer.mark("final model saved")
    run_timer.mark("metrics closed, loss curve drawn")
    fabric.print(f"Saved the final model to {out_dir / FINAL_DIR}")
    if run.log.timings:
        fabric.print(run_timer.report())


def train_loop(
    fabric: Fabric,
    run: RunConfig,
    state: TrainState,
    metrics: Any,
    checkpointer: Checkpointer,
    evaluate: Callable[[int], None],
    context: ContextShard | None = None,
    objective: Objective | None = None,
) -> None:
    """Train from `state` to the last step: what happens each step, in order. `evaluate(step)` validates;
    `context` is this rank's place in its context group (`parallel.context_shard`); `objective` is what each
    step minimizes (default: token-weighted cross-entropy)."""
    preemption = PreemptionFlag.install()
    layout = run.layout
    geometry = step_geometry(run.train, layout.data_replicas)
    accumulation = geometry.accumulation_steps
    total_steps = total_optimizer_steps(run.train, state.train_loader, geometry)
    profiler = StepProfiler(
        profiled_steps(run.log.profile_steps),
        run.out_dir / PROFILE_DIR,
        fabric.global_rank,
        fabric.device,
        report=fabric.print,
    )
    first_step = state.step + 1
    batches = iter(state.train_loader)
    # Tensorwise float8 weights that FSDP2 all-gathers in float8 need their scales after every update.
    gathers_float8 = run.train.float8 == "tensorwise" and fabric.world_size > 1
    after_update = functools.partial(precompute_float8_scales, state.model) if gathers_float8 else None
    while state.step < total_steps:
        with profiler.step(state.step + 1):  # from fetching the step's batches to the optimizer's update
            micro_batches, state.epoch, batches = next_micro_batches(
                batches, state.train_loader, state.epoch, accumulation
            )
            if micro_batches is None:
                raise LitsftError(
                    "the training data cannot fill one optimizer step; lower --train.global_batch_size"
                )
            lr = learning_rate(run.optimizer, state.step, total_steps)
            set_learning_rate(state.optimizer, lr)  # times each group's factor (LoRA+)
            routing = RoutingTally() if run.config.num_experts else None
            objective_means: dict[str, torch.Tensor] = {}
            loss, grad_norm, target_tokens, input_tokens = train_step(
                fabric,
                state.model,
                state.optimizer,
                micro_batches,
                run.train.max_norm,
                layout,
                seed=run.seed,
                step=state.step + 1,
                routing=routing,
                after_update=after_update,
                context=context,
                objective=objective,
                objective_means=objective_means,
            )
        state.step += 1
        step = state.step
        state.skipped_steps += diverged(fabric, loss, grad_norm)
        fault_point(f"after_step_{step}", fabric.global_rank)
        log = step % run.train.log_interval == 0 or step == total_steps
        validate_now = run.eval.interval and step % run.eval.interval == 0 and step < total_steps
        save = run.train.save_interval and step % run.train.save_interval == 0
        must_stop = preemption.is_set(fabric)
        if log or validate_now or save or must_stop:  # steps that wait for the device anyway
            raise_if_diverged(state.skipped_steps, step)
        metrics.step_done(
            step,
            epoch=state.epoch,
            loss=loss,
            learning_rate=lr,
            grad_norm=grad_norm,
            target_tokens=target_tokens,
            input_tokens=input_tokens,
            micro_batches=micro_batches,
            log=log,
            routing=routing.metrics(fabric, target_tokens) if routing is not None and log else None,
            objective_means=objective_means or None,
        )
        if validate_now or save or must_stop:
            with metrics.paused():  # waits for the device: only on the steps that leave the loop's timing
                if validate_now:
                    evaluate(step)
                if save or must_stop:
                    checkpointer.save(state, wait=must_stop)
        if must_stop:
            preemption.checkpoint_published(finish=metrics.close)  # a second Ctrl-C now loses no step
            fault_point("stop_checkpoint_published", fabric.global_rank)
            fabric.print(f"Stopped by a signal after step {step}; relaunch the same command to resume.")
            raise SystemExit(PREEMPTED_EXIT_CODE)
    profiler.report_unprofiled(first_step, total_steps)


# ---- setup ----------------------------------------------------------------------------------------------
def set_aside_damaged(fabric: Fabric, resume: Any, out_dir: Path) -> None:
    """Move damaged step checkpoints aside (before any rank looks for the one to resume from) and say which,
    how, and where the run goes on from: a damaged checkpoint left in place would be skipped without a word,
    and its step's next save would collide with it."""
    notices = set_aside_damaged_checkpoints(out_dir)
    if not notices:
        return
    intact = resume_checkpoint(resume, out_dir)
    goes_on = (
        f"resuming from {intact.name}" if intact else "no intact checkpoint is left: training starts over"
    )
    for notice in notices:
        fabric.print(f"{notice}; {goes_on}")


def setup_data(fabric: Fabric, run: RunConfig, tokenizer: Any) -> tuple[Any, Any]:
    """Prepare the data on the first rank (tokenizing, caching), then this rank's train and val loaders."""
    run.data.connect(tokenizer, max_seq_length=run.train.max_seq_length, seed=run.seed)
    if fabric.is_global_zero:
        if fabric.world_size > 1:  # one line for all ranks: each notice is printed once
            print(
                f"Rank 0 prepares the data; the other {fabric.world_size - 1} ranks wait for it", flush=True
            )
        run.data.prepare()
    fabric.barrier()
    run.data.setup()
    # The ranks of a context group read the same micro-batches: the loaders deal to data replicas.
    layout = run.layout
    data_rank, replicas = layout.data_rank(fabric.global_rank), layout.data_replicas
    train_loader = run.data.train_dataloader(
        rank=data_rank,
        world_size=replicas,
        micro_batch_size=run.train.micro_batch_size,
        global_batch_size=run.train.global_batch_size,
    )
    val_loader = run.data.val_dataloader(
        rank=data_rank, world_size=replicas, micro_batch_size=run.train.micro_batch_size
    )
    return train_loader, val_loader


def setup_model(fabric: Fabric, recipe: Recipe, run: RunConfig) -> nn.Module:
    """Build on the meta device, shard, materialize, then fill: no rank ever holds a full copy it does not need."""
    with torch.device("meta"):
        model = recipe.build_model(run.config)
    if run.precision in ("bf16-mixed", "16-mixed"):
        store_frozen_in_compute_dtype(model, COMPUTE_DTYPE[run.precision])
    config = run.config
    model.attention_kernel = choose_kernel(
        fabric.device.type,
        COMPUTE_DTYPE[run.precision],
        windowed=config.sliding_window is not None,
        dropout=config.attention_dropout,
    )
    softcapped = config.softcap_attention is not None
    described = describe_kernel(model.attention_kernel, softcapped, config.attention_sinks)
    fabric.print(f"Attention: {model.attention_kernel}, {described}")
    compile_blocks = on_cuda_by_default(run.train.compile, fabric.device.type)
    if fabric.world_size == 1:  # with more processes, Fabric's setup_module calls parallelize
        parallelize(model, None, run.fsdp, run.precision, compile_blocks, run.train.float8)
        model.to_empty(device=fabric.device)
        model.tie_weights()
    model = fabric.setup_module(model)
    # Recipes, checkpoints and exports see the model itself, with its own parameter names.
    reset_balancing_biases(model.module)  # what a checkpoint without them leaves, and pretraining starts from
    recipe.initialize(model.module)
    fabric.print(trainable_memory_report(model.module, run.config))
    return model


def check_prompts_of(data: Any) -> list[list[dict[str, str]]]:
    """The run's first two validation prompts of at most CHECK_PROMPT_TOKENS tokens (SFT data), which its
    checkpoints and final/ keep: `convert_to_hf --check` asks them of the export."""
    if not hasattr(data, "validation_conversations"):
        return []
    conversations = data.validation_conversations(8)
    return [c for c in conversations if len(data.chat_format.encode_prompt(c)) <= CHECK_PROMPT_TOKENS][:2]


COMPUTE_DTYPE: dict[str, torch.dtype] = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "32-true": torch.float32,
}


def store_frozen_in_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep frozen parameters (LoRA's base) in the compute dtype under mixed precision. Mixed precision holds
    fp32 master weights so that small updates are not rounded away; a frozen weight gets no updates, and
    autocast would cast it to `dtype` at every use anyway (its matmuls see the same values). Stored in
    `dtype` it takes half the memory and no per-step cast. Trained parameters and their optimizer states
    stay fp32."""
    for param in model.parameters():
        if not param.requires_grad and not is_nf4(param):  # NF4 (QLoRA) is smaller still; .to() dequantizes
            param.data = param.data.to(dtype)


def trainable_memory_report(model: nn.Module, config: Config) -> str:
    """One line comparing what training holds for the trained parameters (fp32 weights, gradients and
    AdamW's two moments: 16 bytes each) with what full fine-tuning of the same model would hold, and the
    frozen weights' memory (LoRA's base) in the dtype they are stored in."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = [p for p in model.parameters() if not p.requires_grad]  # a tied weight is listed once
    full = num_parameters(config)
    mib = 16 / 2**20
    line = (
        f"Trainable parameters: {trainable:,} of {full:,}; params+grads+AdamW state {trainable * mib:,.1f} MiB "
        f"vs {full * mib:,.1f} MiB for full fine-tuning ({trainable / full:.2%})"
    )
    if frozen:
        frozen_mib = sum(stored_bytes(p) for p in frozen) / 2**20
        dtypes = ", ".join(
            sorted({"nf4" if is_nf4(p) else str(p.dtype).removeprefix("torch.") for p in frozen})
        )
        line += f"; frozen weights {frozen_mib:,.1f} MiB ({dtypes})"
    return line + ", before sharding"


def total_optimizer_steps(train: TrainConfig, loader: Any, geometry: StepGeometry) -> int:
    if train.max_steps is not None:
        return train.max_steps
    accumulation = geometry.accumulation_steps
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


# ---- the end of a run ---------------------------------------------------------------------------------------
def save_final(
    fabric: Fabric,
    recipe: Recipe,
    model: nn.Module,
    out_dir: Path,
    validation_prompts: list[list[dict[str, str]]] = (),
) -> None:
    """Write the final model under a temporary name and publish it with one rename: a final/ directory
    always holds a complete model, and a relaunch never trains again over it. The run's first validation
    prompts (`check_prompts_of`) go with it, for `convert_to_hf --check`."""
    final, staging = out_dir / FINAL_DIR, out_dir / f".{FINAL_DIR}.partial"
    fix = "free disk space or fix permissions, then relaunch the same command: it resumes from the last checkpoint"
    publish = publish_atomically(final, "the final model", staging, fix)
    # Rank 0 publishes; every rank writes its parts of the weights into the staging directory.
    with publish if fabric.is_global_zero else nullcontext(staging):
        fabric.barrier()
        recipe.save_final(model, staging)
        if fabric.is_global_zero:
            write_validation_prompts(staging, validation_prompts)
        fabric.barrier()
        fault_point("final_before_rename", fabric.global_rank)
    fabric.barrier()
