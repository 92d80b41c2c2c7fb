"""AdamW and the learning-rate schedule. Warmup and decay are counted in optimizer steps everywhere."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from litsft.errors import LitsftError, check_number


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 2e-5
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of a cosine or linear decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices and embeddings only (not to norms and biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warmup."""
    warmup_steps: int | None = None
    """Linear warmup length in optimizer steps."""
    warmup_fraction: float = 0.0
    """Warmup as a fraction of all optimizer steps; used when warmup_steps is not given."""

    def __post_init__(self) -> None:
        check_number(
            "--optimizer.lr", self.lr, above=0, fix="use e.g. 2e-5 (full fine-tuning) or 2e-4 (LoRA)"
        )
        check_number("--optimizer.min_lr", self.min_lr, at_least=0, fix="use 0 to decay to zero")
        if self.min_lr > self.lr:
            raise LitsftError(
                f"--optimizer.min_lr={self.min_lr} is above --optimizer.lr={self.lr}, so the schedule would rise "
                "instead of decay; use a min_lr of at most lr (e.g. lr / 10, or 0)"
            )
        check_number(
            "--optimizer.weight_decay", self.weight_decay, at_least=0, fix="use 0 for none, e.g. 0.1"
        )
        for beta in self.betas:
            check_number("--optimizer.betas", beta, at_least=0, below=1, fix="use e.g. [0.9, 0.95]")
        check_number("--optimizer.eps", self.eps, above=0, fix="use e.g. 1e-8")
        check_number("--optimizer.warmup_steps", self.warmup_steps, at_least=0, fix="use 0 for no warmup")
        check_number(
            "--optimizer.warmup_fraction", self.warmup_fraction, at_least=0, at_most=1,
            fix="it is the share of all steps spent warming up, e.g. 0.03",
        )  # fmt: skip


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, fused where the device supports it."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise LitsftError("the model has no trainable parameters; check which parameters the recipe trains")
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    device = next(model.parameters()).device
    # Fused AdamW is one kernel per parameter group on CUDA and on CPU; on CPU it also beats foreach 3.7x
    # (24 x 768 x 2048 fp32: 154 vs 569 ms a step, 1 thread) and needs no parameter-sized temporary.
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        fused=True if device.type in ("cuda", "cpu") else None,
    )


def warmup_steps(config: OptimizerConfig, total_steps: int) -> int:
    if config.warmup_steps is not None:
        return config.warmup_steps
    return int(config.warmup_fraction * total_steps)


def learning_rate(config: OptimizerConfig, step: int, total_steps: int) -> float:
    """The learning rate for optimizer step `step` (0-based) of `total_steps`."""
    warmup = warmup_steps(config, total_steps)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if config.schedule == "constant":
        return config.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if config.schedule == "linear":
        return config.lr + (config.min_lr - config.lr) * progress
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))
