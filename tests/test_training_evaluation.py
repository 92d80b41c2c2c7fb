"""litsft/training/evaluation.py: the validation loss is the mean over every target token of the batches scored, the
same batches on every pass, at most --eval.max_batches of them, with the model left in training mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from litsft.model.config import Config
from litsft.model.network.transformer import Transformer
from litsft.training.args import EvalConfig, RunConfig
from litsft.training.evaluation import validate


class Loader:
    """Fixed batches; `set_epoch` rewinds, like the data modules' loaders."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches, self.epochs = batches, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(self.batches)


class Metrics:
    def __init__(self) -> None:
        self.passes: list[tuple[int, dict]] = []

    def validation_done(self, step: int, **values: object) -> None:
        self.passes.append((step, values))


def batch(targets: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 512, (2, 12), generator=generator)
    labels[:, targets:] = -100
    return {"input_ids": torch.randint(0, 512, (2, 12), generator=generator), "labels": labels}


def mean_token_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    with torch.no_grad():
        summed = sum(
            F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), reduction="sum")
            for b in batches
        )
    return (summed / sum(int((b["labels"] != -100).sum()) for b in batches)).item()


@pytest.fixture
def model_and_fabric() -> tuple[torch.nn.Module, Fabric]:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    return fabric.setup(Transformer(Config.from_name("tiny-llama"))), fabric


def run(max_batches: int | None) -> RunConfig:
    return RunConfig(
        Config.from_name("tiny-llama"),
        None,
        None,
        Path("out"),
        eval=EvalConfig(max_batches=max_batches, max_new_tokens=0),
    )


def test_the_loss_is_the_mean_over_target_tokens_of_the_batches_scored(model_and_fabric) -> None:
    model, fabric = model_and_fabric
    batches = [batch(targets=1, seed=1), batch(targets=12, seed=2), batch(targets=6, seed=3)]
    loader, metrics = Loader(batches), Metrics()
    validate(fabric, model, loader, None, run(max_batches=2), metrics, step=7)
    validate(fabric, model, loader, None, run(max_batches=2), metrics, step=8)
    (step, first), (_, second) = metrics.passes
    assert step == 7 and first["tokens"] == 2 * 1 + 2 * 12 and first["sample"] is None
    assert first["loss"] == pytest.approx(mean_token_loss(model, batches[:2]), rel=1e-5)
    assert second == first and loader.epochs == [0, 0]  # the same batches every pass
    assert model.training
    validate(fabric, model, loader, None, run(max_batches=None), metrics, step=9)
    assert metrics.passes[-1][1]["loss"] == pytest.approx(mean_token_loss(model, batches), rel=1e-5)


def test_nothing_is_logged_without_validation_data(model_and_fabric) -> None:
    model, fabric = model_and_fabric
    metrics = Metrics()
    validate(fabric, model, None, None, run(max_batches=2), metrics, step=1)
    assert metrics.passes == []
