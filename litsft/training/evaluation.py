"""Validation during and after training: the held-out loss over the same batches on every pass, a greedy
sample of the first validation conversation's prompt (SFT data), written beside the metrics, and the scores
of `--eval.tasks`."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from litsft.model.network.context_parallel import ContextShard
from litsft.training.args import RunConfig
from litsft.training.eval_tasks import TrainingTasks
from litsft.training.objectives import Objective, TokenCrossEntropy
from litsft.training.parallel import reshard
from litsft.training.step import sum_over_ranks, to_device


@torch.no_grad()
def validate(
    fabric: Fabric,
    model: nn.Module,
    val_loader: Any,
    tokenizer: Any,
    run: RunConfig,
    metrics: Any,
    step: int,
    context: ContextShard | None = None,
    objective: Objective | None = None,
    tasks: TrainingTasks | None = None,
) -> None:
    """The held-out loss of `objective` (default: token-weighted cross-entropy) over the validation batches
    (each rank of a context group its slice of the rows its group shares, `context`), a greedy sample, and
    the scores of `--eval.tasks` (`tasks`)."""
    if tasks is not None:
        model.eval()
        results = tasks.score(fabric, model)
        reshard(model)
        model.train()
        metrics.tasks_done(step, results)
    if val_loader is None:
        return
    objective = objective or TokenCrossEntropy()
    model.eval()
    # From the first batch on every pass: the loader would otherwise go on where the last pass stopped, and
    # passes would score different batches (or none once it is used up).
    val_loader.set_epoch(0)
    # The loss, its units, then the objective's logged statistics (a preference objective's rewards).
    totals = torch.zeros(2 + len(objective.logged), device=fabric.device)
    objective.take_sums()  # what the last training step left
    for i, batch in enumerate(val_loader):
        if run.eval.max_batches is not None and i >= run.eval.max_batches:
            break
        batch = to_device(batch, fabric.device, context)
        totals[0] += objective.summed_loss(model, batch)
        totals[1] += objective.units(batch)
    sums = objective.take_sums()
    if sums is not None:
        totals[2:] = sums
    totals = sum_over_ranks(fabric, totals)
    sample = generate_sample(model, tokenizer, run)
    reshard(model)  # a checkpoint may follow before the next backward pass
    model.train()
    if totals[1] > 0:
        means = (totals / totals[1]).tolist()
        metrics.validation_done(
            step,
            loss=means[0],
            tokens=int(totals[1].item()),
            sample=sample,
            objective_means=dict(zip(objective.logged, means[2:])) or None,
        )


def generate_sample(model: nn.Module, tokenizer: Any, run: RunConfig) -> str | None:
    """Greedy completion of the first validation conversation's prompt (SFT data modules). Every rank
    generates it: forwards of a sharded model are collective."""
    if run.eval.max_new_tokens <= 0 or not hasattr(run.data, "validation_prompts"):
        return None
    prompts = run.data.validation_prompts(1)
    if not prompts:
        return None
    from litsft.inference.generate import generate_batch

    completion = generate_batch(
        model, prompts[:1], max_new_tokens=run.eval.max_new_tokens, stop_ids=tokenizer.stop_ids
    )[0]
    return tokenizer.decode(prompts[0], skip_special_tokens=False) + tokenizer.decode(completion)
