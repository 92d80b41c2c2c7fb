"""litsft/step.py: one optimizer step. The loss weighs every target token the same whatever the micro-batch
it falls in, the token counts it returns, epochs rolling over to fill a step, and skipped-step accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from litsft.args import OptimizerConfig
from litsft.config import Config
from litsft.errors import LitsftError
from litsft.model import Transformer
from litsft.optimizer import build_optimizer
from litsft.step import next_micro_batches, raise_if_diverged, train_step

VOCAB = 512


def micro_batch(rows: int, length: int, targets: int, seed: int) -> dict[str, torch.Tensor]:
    """`rows` x `length` tokens of which the first `targets` of each row carry a loss."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (rows, length), generator=generator)
    labels[:, targets:] = -100
    return {"input_ids": torch.randint(0, VOCAB, (rows, length), generator=generator), "labels": labels}


def setup(lr: float = 0.0) -> tuple[Fabric, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = Transformer(Config.from_name("tiny-llama"))
    return fabric, *fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=lr or 1e-9)))


def reference_loss_and_grads(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]):
    """Mean cross-entropy over every target token of every batch, from the logits, and its gradients."""
    model.zero_grad()
    summed = sum(
        F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), reduction="sum")
        for b in batches
    )
    tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
    (summed / tokens).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return (summed / tokens).item(), grads


def test_the_loss_weighs_each_target_token_the_same_across_micro_batches() -> None:
    """Two micro-batches with 2 and 12 target tokens a row: the step's loss and gradients are those of the mean
    over all 28 tokens, not the mean of the two micro-batches' means."""
    fabric, model, optimizer = setup()
    batches = [micro_batch(2, 16, targets=2, seed=1), micro_batch(2, 16, targets=12, seed=2)]
    expected_loss, expected_grads = reference_loss_and_grads(model, batches)
    captured: dict[str, torch.Tensor] = {}  # each parameter's gradient, summed over the backward passes
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: captured.__setitem__(name, captured.get(name, 0) + grad))
    loss, grad_norm, target_tokens, input_tokens = train_step(
        fabric, model, optimizer, batches, max_norm=None
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert (int(target_tokens), int(input_tokens)) == (2 * 2 + 2 * 12, 2 * 2 * 16)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(captured[name], grad, rtol=1e-4, atol=1e-6)
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected_grads.values()]))
    assert grad_norm.item() == pytest.approx(expected_norm.item(), rel=1e-4)
    # Equal weighting would give another loss: the test can tell the two apart.
    means = [reference_loss_and_grads(model, [b])[0] for b in batches]
    assert abs(sum(means) / 2 - expected_loss) > 1e-3


def test_padding_is_not_counted_as_input_tokens() -> None:
    fabric, model, optimizer = setup()
    batch = micro_batch(2, 16, targets=5, seed=3)
    batch["document_ids"] = torch.zeros(2, 16, dtype=torch.long)
    batch["document_ids"][1, 10:] = -1  # the end of the second row is padding
    _, _, target_tokens, input_tokens = train_step(fabric, model, optimizer, [batch], max_norm=1.0)
    assert (int(target_tokens), int(input_tokens)) == (10, 32 - 6)


def test_the_reported_norm_is_the_one_before_clipping() -> None:
    fabric, model, optimizer = setup(lr=1e-3)
    batch = micro_batch(2, 16, targets=16, seed=4)
    _, unclipped, _, _ = train_step(fabric, model, optimizer, [batch], max_norm=None)
    fabric, model, optimizer = setup(lr=1e-3)
    _, reported, _, _ = train_step(fabric, model, optimizer, [batch], max_norm=1e-3)
    assert reported.item() == pytest.approx(unclipped.item(), rel=1e-5) and reported.item() > 1e-3


class Loader:
    """An epoch of `size` numbered batches; `set_epoch` records the epochs it was asked for."""

    def __init__(self, size: int) -> None:
        self.size, self.epochs = size, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.size))


def test_micro_batches_fill_a_step_and_roll_over_into_the_next_epoch() -> None:
    loader = Loader(5)
    batches = iter(loader)
    first, epoch, batches = next_micro_batches(batches, loader, epoch=0, accumulation=2)
    second, epoch, batches = next_micro_batches(batches, loader, epoch, accumulation=2)
    assert (first, second, epoch, loader.epochs) == ([0, 1], [2, 3], 0, [])
    # One batch is left: it cannot fill a step, so the step is the next epoch's first two batches.
    third, epoch, batches = next_micro_batches(batches, loader, epoch, accumulation=2)
    assert (third, epoch, loader.epochs) == ([0, 1], 1, [1])


def test_a_loader_too_short_for_one_step_gives_none() -> None:
    loader = Loader(1)
    assert next_micro_batches(iter(loader), loader, epoch=0, accumulation=2)[0] is None


def test_skipped_steps_stop_the_run_with_their_count() -> None:
    raise_if_diverged(torch.tensor(0), step=10)
    with pytest.raises(LitsftError, match="inf or NaN in 3 of the first 10 steps"):
        raise_if_diverged(torch.tensor(3), step=10)
