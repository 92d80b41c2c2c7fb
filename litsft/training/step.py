"""One optimizer step: micro-batches gathered for gradient accumulation, moved to the device, forward and
backward with the objective's loss weighted by its global count of units, target tokens for cross-entropy
(litsft.training.objectives), (and LoRA's dropout masks keyed to each
sample's place in the global batch), clipping, and an update that a non-finite gradient norm skips on the
device. Nothing here makes the host wait for the device."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from litsft.errors import LitsftError
from litsft.model.network.attention import Documents
from litsft.model.network.batch import model_inputs, split_for_context
from litsft.model.network.context_parallel import ContextShard
from litsft.model.network.moe import expert_load, update_balancing_bias
from litsft.model.network.sample_dropout import (
    DropoutSamples,
    context_samples,
    dropout_samples,
    samples_in_micro_batch,
)
from litsft.model.network.transformer import Transformer
from litsft.training.layout import ParallelLayout
from litsft.training.objectives import Objective, TokenCrossEntropy
from litsft.training.parallel import synchronize_gradients


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


class RoutingTally:
    """A mixture of experts' routing over one optimizer step, for the logs: the load-balancing loss as the
    objective weighs it (each sequence's by its loss tokens, over the global count) and the assignments each
    expert of each layer received (litsft.training.metrics.expert_balance reads the balance from them), over
    every micro-batch of every rank. On the device until a log step reads it."""

    def __init__(self) -> None:
        self.weighted_loss: torch.Tensor | None = None
        self.expert_tokens: torch.Tensor | None = None

    def add(self, model: nn.Module) -> None:
        """Count the training forward pass `model` just ran."""
        expert_tokens = expert_load(model)
        transformer = next(module for module in model.modules() if isinstance(module, Transformer))
        weighted = transformer.balancing_loss_sum
        if expert_tokens is None or weighted is None:
            return
        if self.weighted_loss is None or self.expert_tokens is None:
            self.weighted_loss, self.expert_tokens = weighted, expert_tokens
        else:
            self.weighted_loss = self.weighted_loss + weighted
            self.expert_tokens = self.expert_tokens + expert_tokens

    def balance(self, fabric: Fabric, model: nn.Module) -> None:
        """With the model's router_bias_update_rate, move its routers' balancing biases by the step's expert
        load over every rank (litsft.model.network.moe.update_balancing_bias; a collective: every rank calls it).
        Nothing is read on the host."""
        transformer = next(module for module in model.modules() if isinstance(module, Transformer))
        rate = transformer.config.router_bias_update_rate
        if rate and self.expert_tokens is not None:
            update_balancing_bias(model, sum_over_ranks(fabric, self.expert_tokens.clone()), rate)

    def metrics(self, fabric: Fabric, target_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """router_aux_loss and expert_tokens (L, E) over every rank (a collective: every rank calls it)."""
        if self.weighted_loss is None or self.expert_tokens is None:
            return {}
        totals = sum_over_ranks(fabric, torch.cat([self.weighted_loss[None], self.expert_tokens.flatten()]))
        expert_tokens = totals[1:].view_as(self.expert_tokens)  # (L, E)
        return {"router_aux_loss": totals[0] / target_tokens, "expert_tokens": expert_tokens}


def train_step(
    fabric: Fabric,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, torch.Tensor]],
    max_norm: float | None,
    layout: ParallelLayout | None = None,
    seed: int = 0,
    step: int = 1,
    routing: RoutingTally | None = None,
    after_update: Callable[[], None] | None = None,
    context: ContextShard | None = None,
    objective: Objective | None = None,
    objective_means: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over the micro-batches of this rank, minimizing `objective` (default: token-weighted
    cross-entropy). Returns (mean loss, grad norm, the objective's units, non-padding input tokens), all global
    and still on the device: nothing here makes the host wait for it.
    `layout` (default: this world's processes, FULL_SHARD) says which share of the global batch this rank's
    micro-batches are and how their gradients are reduced (`synchronize_gradients`); without FSDP (one process)
    the latter changes nothing. With `context`, this rank trains its slice of every row of the micro-batches
    its context group shares (`split_for_context`), and each token is counted once. LoRA's dropout masks come
    from (`seed`, `step`, each sample's position in the global batch): `dropout_samples_of`. A mixture of
    experts adds its load-balancing loss's gradient in its forward pass
    (litsft.model.network.transformer.Transformer.router_loss_gradient); `routing` counts what its routers
    did, for the logs, and moves their balancing biases after the update (`RoutingTally.balance`).
    `after_update` runs after the optimizer step (float8's scales). `objective_means`, when given, is filled
    with the objective's logged statistics of the step (`Objective.logged`), global means over its units."""
    device = fabric.device
    layout = layout or ParallelLayout(fabric.world_size)
    objective = objective or TokenCrossEntropy()
    whole = [model_inputs(mb) for mb in micro_batches]
    samples = dropout_samples_of(
        micro_batches, whole, layout.data_rank(fabric.global_rank), seed, step, context
    )
    inputs = [move_to_device(w, device, context) for w in whole]
    # Counted on the host, where the batches are, and copied like them: a tensor made from host values
    # directly on a GPU (torch.tensor(..., device=...)) is a copy the host waits for. Loss tokens are each
    # rank's own (a context rank's slice); a context group's ranks share their micro-batches' input tokens,
    # which its first rank counts.
    input_tokens = sum(sum(row_lengths(mb)) for mb in micro_batches)
    counts = torch.tensor(
        [
            sum(objective.units(batch) for batch in inputs),
            input_tokens if context is None or context.rank == 0 else 0,
        ]
    )
    counts = sum_over_ranks(fabric, copy_to_device(counts, device))
    units = counts[0].clamp(min=1)
    # Each rank's summed loss is divided by the *global* count of units (target tokens), so every unit weighs
    # the same whatever the packing, micro-batch size or number of ranks. FSDP averages gradients over ranks,
    # which the factor world_size undoes.
    scale = fabric.world_size / units
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(inputs):
        synchronize_gradients(model, layout.sharding_strategy, last_micro_batch=i == len(inputs) - 1)
        with dropout_samples(model, samples[i]):  # the backward pass recomputes checkpointed masks
            loss = objective.summed_loss(model, batch)
            fabric.backward(loss * scale)
        loss_sum += loss.detach()
        if routing is not None:
            routing.add(model)
    # Fabric's wrapper hands step() to the optimizer it wraps, which is where the scaler and AdamW look.
    inner_optimizer = getattr(optimizer, "optimizer", optimizer)
    scaler = loss_scaler(fabric)
    if scaler is not None:
        # 16-mixed: backward left the gradients multiplied by the loss scale (2**16 at first). Unscaled before
        # clipping, so that max_norm and the reported norm are those of the true gradients; the scaler records
        # whether they overflowed, and its step() then hands that flag to AdamW instead of unscaling again.
        scaler.unscale_(inner_optimizer)
    grad_norm = clip_gradients(model, max_norm)
    if scaler is None:
        # Checked on the device, not read by the host: with `found_inf` set (the flag torch's GradScaler uses),
        # fused AdamW leaves parameters, moments and step count alone when the norm is inf or NaN. The loop
        # reports it at its next synchronization (`raise_if_diverged`).
        inner_optimizer.found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    optimizer.step()
    if routing is not None:
        routing.balance(fabric, model)
    if after_update is not None:
        after_update()
    optimizer.zero_grad(set_to_none=True)
    sums = objective.take_sums()
    if sums is None:
        loss = sum_over_ranks(fabric, loss_sum) / units
    else:  # the statistics ride on the loss's all-reduce
        totals = sum_over_ranks(fabric, torch.cat([loss_sum[None], sums])) / units
        loss = totals[0]
        if objective_means is not None:
            objective_means.update(zip(objective.logged, totals[1:]))
    return loss, grad_norm, counts[0], counts[1]


def loss_scaler(fabric: Fabric) -> torch.amp.GradScaler | None:
    """The GradScaler of fp16 mixed precision (16-mixed), None under every other precision."""
    return getattr(fabric.strategy.precision, "scaler", None)


def diverged(fabric: Fabric, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """Whether this step's update was skipped because training diverged (a bool tensor, on the device).

    Without loss scaling, an inf or NaN gradient norm is divergence. Under 16-mixed it is also how the
    scaler finds its scale: a finite loss whose scaled gradients overflowed fp16 has its update skipped and
    the scale halved, which is calibration, not divergence; a non-finite loss is divergence either way."""
    if loss_scaler(fabric) is None:
        return ~torch.isfinite(grad_norm)
    return ~torch.isfinite(loss)


def sum_over_ranks(fabric: Fabric, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over every rank, in place. Not `fabric.all_reduce`: Lightning runs a barrier before each
    reduction (`_sync_ddp` in lightning/fabric/utilities/distributed.py), and on NCCL a barrier's wait
    synchronizes the CUDA stream (`WorkNCCL::synchronize` in torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp),
    so the host would stop and wait for the device twice a step. A plain all-reduce is queued like a kernel."""
    if fabric.world_size > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


def raise_if_diverged(skipped_steps: torch.Tensor, step: int) -> None:
    """Stop with one line if any optimizer step so far had an inf or NaN gradient norm (and was skipped)."""
    skipped = int(skipped_steps.item())
    if skipped:
        raise LitsftError(
            f"the gradient norm was inf or NaN in {skipped} of the first {step} steps (their updates were "
            "skipped): training diverged or the data holds a broken sample; lower --optimizer.lr, check the "
            "data, or resume from an earlier checkpoint"
        )


def to_device(
    batch: dict[str, torch.Tensor], device: torch.device, context: ContextShard | None = None
) -> dict[str, Any]:
    """The model's inputs of a CPU micro-batch (`model_inputs`: packed rows joined, their documents, the flat
    indices of the labels that carry a loss, all found here on the host; with `context`, this rank's slice of
    every row, `split_for_context`), on `device`, copied without making the host wait."""
    return move_to_device(model_inputs(batch), device, context)


def move_to_device(
    inputs: dict[str, Any], device: torch.device, context: ContextShard | None = None
) -> dict[str, Any]:
    """Model inputs made on the host (`model_inputs`), or this context rank's slice of them
    (`split_for_context`), on `device`, copied without making the host wait."""
    if context is not None:
        inputs = split_for_context(inputs, context)
    moved: dict[str, Any] = {}
    for name, value in inputs.items():
        if isinstance(value, ContextShard | int):
            moved[name] = value
        elif isinstance(value, Documents):
            moved[name] = Documents(copy_to_device(value.cu_seqlens, device), value.max_seqlen)
        else:
            moved[name] = copy_to_device(value, device)
    return moved


def copy_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, copied asynchronously. A copy from pageable host memory to a GPU makes the host
    wait whatever `non_blocking` says (https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html);
    from pinned (page-locked) memory it is queued like a kernel
    (https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers). torch's caching host
    allocator keeps the pinned buffer until the copy has run."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def row_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """The real (not padding) tokens of each row of a host micro-batch: the collate's `row_lengths` (unpacked
    rows are right-padded to the longest), else the tokens in a document, else whole rows (a loader whose
    rows are never padded, such as the pretraining streams)."""
    if "row_lengths" in batch:
        return batch["row_lengths"].tolist()
    if "document_ids" in batch:
        return (batch["document_ids"] >= 0).sum(dim=1).tolist()
    rows, width = batch["input_ids"].shape
    return [width] * rows


def dropout_samples_of(
    micro_batches: list[dict[str, torch.Tensor]],
    inputs: list[dict[str, Any]],
    rank: int,
    seed: int,
    step: int,
    context: ContextShard | None = None,
) -> list[DropoutSamples]:
    """Where each sample of each micro-batch is in the model's input, and its key: (seed, step, its position
    in the global batch). The position is the one the loader dealt it from (`litsft.data.loader`: rank r
    takes the r-th equal share of the global batch, as consecutive micro-batches), so that any split of the
    global batch into ranks, micro-batches and accumulation steps gives each sample the same masks. `rank` is
    the data rank; with `context`, the samples are those of the whole rows, of which this rank draws the
    masks of its slice (`context_samples`); `inputs` are the whole micro-batches' (`model_inputs`)."""
    share = sum(len(batch["input_ids"]) for batch in micro_batches)
    position = rank * share
    samples = []
    for batch, model_input in zip(micro_batches, inputs):
        rows, width = model_input["input_ids"].shape
        lengths = row_lengths(batch)
        joined = rows != len(lengths)  # packed rows joined into one row of their real tokens (model_inputs)
        whole = samples_in_micro_batch(lengths, width, joined, position, seed, step)
        if context is not None:  # split_for_context's one row of the tokens, padded to a multiple of N
            whole = context_samples(whole, context, -(-rows * width // context.size) * context.size)
        samples.append(whole)
        position += len(lengths)
    return samples


def clip_gradients(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global gradient norm over all ranks (clipped to max_norm when given). The norm of each mesh's gradients
    is taken apart and the parts combined: under expert parallelism the experts' gradients are DTensors of
    a mesh of their own, which one norm over every gradient cannot mix with the others'."""
    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    max_norm = max_norm if max_norm else math.inf
    if len(by_mesh) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for mesh, group in by_mesh.items():
        # The same total for every group, as a replicated DTensor of the group's mesh where it has one.
        on_mesh = total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, on_mesh, foreach=True)
    return total
