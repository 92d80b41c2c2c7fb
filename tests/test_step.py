"""One optimizer step (litsft/step.py): loss scaling under 16-mixed, and what a step makes the host wait for."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision

from litsft.args import OptimizerConfig
from litsft.config import Config
from litsft.model import Transformer
from litsft.optimizer import build_optimizer
from litsft.step import diverged, train_step


def _one_step(
    scaler: torch.amp.GradScaler | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad norm, parameter update, diverged) of one train_step of a tiny model, clipped to norm 1.0,
    in fp32 or, with `scaler`, under fp16 autocast with that loss scaler (Fabric's 16-mixed, on the CPU)."""
    torch.manual_seed(0)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if scaler is not None else None
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins)
    model = Transformer(Config.from_name("tiny-llama"))
    model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-3)))
    before = [param.detach().clone() for param in model.parameters()]
    generator = torch.Generator().manual_seed(1)
    batch = {name: torch.randint(0, 512, (2, 32), generator=generator) for name in ("input_ids", "labels")}
    loss, grad_norm, _, _ = train_step(fabric, model, optimizer, [batch], max_norm=1.0)
    update = torch.cat([(param.detach() - old).flatten() for param, old in zip(model.parameters(), before)])
    return loss, grad_norm, update, diverged(fabric, loss, grad_norm)


def test_16_mixed_clips_and_reports_the_unscaled_gradients():
    """Under 16-mixed the gradients are unscaled before clipping: the reported norm and the update are those
    of fp32 training, not those of gradients 2**16 times too large clipped to max_norm (which reported a norm
    of 71,597 and shrank this update to half)."""
    _, fp32_norm, fp32_update, _ = _one_step(None)
    scaler = torch.amp.GradScaler("cpu")
    _, fp16_norm, fp16_update, fp16_diverged = _one_step(scaler)
    assert fp32_norm > 1.0  # clipping is active
    torch.testing.assert_close(fp16_norm, fp32_norm, rtol=1e-2, atol=0)
    # fp16 matmuls change the gradients a little (measured: 2.7% of the update's norm)
    assert (fp16_update - fp32_update).norm() < 0.1 * fp32_update.norm()
    assert not fp16_diverged
    assert scaler.get_scale() == 2.0**16  # no overflow: the scale stays


def test_16_mixed_overflow_skips_the_update_and_lowers_the_scale_without_counting_as_divergence():
    """Scaled gradients that overflow fp16 are how the scaler finds its scale: the update is skipped and the
    scale halved, and the run is not stopped as diverged."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    loss, grad_norm, update, step_diverged = _one_step(scaler)
    assert torch.isfinite(loss) and not torch.isfinite(grad_norm)
    assert torch.count_nonzero(update) == 0
    assert scaler.get_scale() == 2.0**39
    assert not step_diverged
    poisoned = torch.tensor(float("nan"))
    assert diverged(Fabric(accelerator="cpu", devices=1), loss, poisoned)  # without a scaler it is divergence
