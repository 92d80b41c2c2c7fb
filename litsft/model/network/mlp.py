"""A dense block's gated MLP: SwiGLU (Llama and most families) or GeGLU with the tanh-approximated GELU (Gemma),
and the gated activation itself, which the experts of litsft.model.network.moe apply to their own projections."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from litsft.model.config import Config


def gated_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: Literal["silu", "gelu_tanh"] = "silu"
) -> torch.Tensor:
    """activation(gate) * up, both (..., I) -> (..., I): SwiGLU for "silu", GeGLU for "gelu_tanh"."""
    activated = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    return activated * up


class MLP(nn.Module):
    def __init__(self, config: Config, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: another width than the config's dense one (a shared expert's)."""
        super().__init__()
        intermediate = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=False)
        self.activation = config.mlp_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, C) -> (B, T, I) -> (B, T, C)
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))
