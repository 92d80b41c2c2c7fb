"""DoRA, weight-decomposed LoRA (Liu et al. 2024, https://arxiv.org/abs/2402.09353), as PEFT computes it
(https://github.com/huggingface/peft/blob/main/src/peft/tuners/lora/dora.py):

    m / ||W + s B A||_row * (W x + s B A x)

The magnitude m (out,) starts as the row norms of W, so a fresh DoRA adapter changes nothing; it is trained,
while the row norm ||W + s B A|| is treated as a constant in the backward pass (section 4.3 of the paper, and
PEFT). It lives in a module of its own, `lora_magnitude_vector`, so that FSDP2 can gather it like lora_A and
lora_B, and its name matches PEFT's.
"""

from __future__ import annotations

import torch
from torch import nn

from litsft.model.lora.variants.spec import AdapterVariant, ModuleAdapters, dequantized, lora_delta, rows_held

MAGNITUDE = "lora_magnitude_vector"


class DoRA(AdapterVariant):
    extra_modules = (MAGNITUDE,)
    peft_names = {f"{MAGNITUDE}.weight": MAGNITUDE}  # PEFT saves the magnitude without `.weight`

    def add_modules(self, layer: nn.Module) -> None:
        weight = layer.base.weight
        layer.lora_magnitude_vector = DoRAMagnitude(
            layer.base.out_features, device=weight.device, dtype=weight.dtype
        )

    @torch.no_grad()
    def initialize_from_base(self, layer: nn.Module) -> None:
        """The magnitude := the row norms of the base weight (with B = 0, of W + s B A), for the rows of the
        magnitude this rank holds (FSDP2 gives the weight the same rows, or all of them when it leaves an NF4
        weight unsharded)."""
        magnitude, offset = rows_held(layer.lora_magnitude_vector.weight.data)
        weight, weight_offset = rows_held(layer.base.weight.data)
        if magnitude.numel():
            start = offset - weight_offset
            rows = dequantized(weight)[start : start + magnitude.shape[0]]
            magnitude.copy_(torch.linalg.vector_norm(rows.float(), dim=1))

    def update(
        self, layer: nn.Module, x: torch.Tensor, h: torch.Tensor, result: torch.Tensor
    ) -> torch.Tensor:
        # Computed as PEFT does: W x is the base output without its bias (recomputed on the dropped-out input
        # when dropout is active), the row norms of W + s B A come from B A through the adapters' own forward
        # (so a sharded adapter is gathered the way FSDP gathers it) and are held constant.
        update = super().update(layer, x, h, result)
        weight = dequantized(layer.base.weight).to(x.dtype)
        eye = torch.eye(layer.lora_A.in_features, device=x.device, dtype=x.dtype)
        delta = layer.lora_B(layer.lora_A(eye)).t() * layer.scaling  # (out, in)
        row_norm = torch.linalg.vector_norm(weight + delta.detach(), dim=1).detach()
        if isinstance(layer.dropout, nn.Identity) or not layer.training:
            bias = layer.base.bias
            plain = result if bias is None else result - bias
        else:
            plain = nn.functional.linear(h, weight)
        return layer.lora_magnitude_vector(plain, update, row_norm)

    def merged_weight(self, weight: torch.Tensor, adapters: ModuleAdapters, scaling: float) -> torch.Tensor:
        """Each row of W + s B A rescaled to its trained magnitude, as PEFT merges it."""
        merged = weight + lora_delta(adapters["lora_A.weight"], adapters["lora_B.weight"], scaling).to(
            weight.device
        )
        magnitude = adapters[f"{MAGNITUDE}.weight"].float().to(merged.device)
        return merged * (magnitude / torch.linalg.vector_norm(merged, dim=1))[:, None]

    def peft_config(self) -> dict[str, object]:
        return {**super().peft_config(), "use_dora": True}


class DoRAMagnitude(nn.Module):
    """DoRA's trained magnitude, one value per output row."""

    def __init__(
        self, out_features: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(out_features, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        # Placeholder until the base weights are loaded (`DoRA.initialize_from_base`).
        nn.init.ones_(self.weight)

    def forward(self, plain: torch.Tensor, update: torch.Tensor, row_norm: torch.Tensor) -> torch.Tensor:
        """The DoRA output minus the base output: (m / n - 1) W x + (m / n) s B A x."""
        scale = (self.weight / row_norm).to(plain.dtype)
        return (scale - 1) * plain + scale * update


VARIANT = DoRA()
