"""PiSSA, principal singular values and singular vectors adaptation (Meng et al. 2024,
https://arxiv.org/abs/2404.02948), as PEFT's `init_lora_weights="pissa"` initializes it
(https://github.com/huggingface/peft/blob/main/src/peft/tuners/lora/layer.py, `pissa_init`): with
W = U S V^T and s = alpha / r,

    A = sqrt(S_r / s) V_r^T (r, in),   B = U_r sqrt(S_r / s) (out, r),   base := W - s B A (the residual)

so the adapter starts as W's principal rank-r part and trains it, while the model is unchanged at step 0 (up
to rounding). The forward pass is plain LoRA's on the residual base.

What a run keeps. The initial A and B (A0, B0) are buffers of each adapted layer, in module `pissa_initial`:
they are saved with the adapters in the LoRA folder, so the residual W - s B0 A0 can be rebuilt from the
original base exactly (a merge, generate, the PEFT export), without a second SVD that another device could
round differently. Step checkpoints hold the trained A and B only; a resumed run re-derives A0, B0 and the
residual from the base it loads (the SVD of the whole weight, gathered on every rank, so the number of ranks
does not change it; the same device type gives the same bits).

The PEFT export is PEFT's PiSSA-to-LoRA conversion (`save_pretrained(path_initial_model_for_weight_conversion=...)`,
`LoraModel.subtract_mutated_init`): W_res + s B A = W + s (B A - B0 A0) = W + s [B | -B0] [A ; A0], a plain
LoRA of rank 2r with alpha 2 alpha (the same scaling) on the ORIGINAL base.

Not supported: an NF4 base (QLoRA's NF4 weights are the original W; PiSSA would quantize the residual) and
lm_head on tied embeddings (the residual would change the input embeddings too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from litsft.errors import LitsftError
from litsft.model.lora.variants.spec import AdapterVariant, ModuleAdapters, full_weight, lora_delta, rows_held

if TYPE_CHECKING:
    from litsft.model.config import Config
    from litsft.model.lora.config import LoRAConfig, Quantization

INITIAL = "pissa_initial"


class PiSSA(AdapterVariant):
    extra_modules = (INITIAL,)

    def check(self, lora: LoRAConfig, config: Config, quantize: Quantization | None) -> None:
        super().check(lora, config, quantize)
        if quantize is not None:
            raise LitsftError(
                f"--lora.variant pissa with --quantize {quantize} is not supported: PiSSA trains on the residual "
                "of the base weights, which would have to be quantized after the decomposition; drop --quantize "
                "or use --lora.variant lora"
            )
        if config.tie_word_embeddings and "lm_head" in lora.target_list:
            raise LitsftError(
                f"--lora.variant pissa on lm_head: {config.name} ties lm_head to the input embeddings, which "
                "PiSSA's residual would change too; leave lm_head out of --lora.targets"
            )

    def add_modules(self, layer: nn.Module) -> None:
        weight = layer.lora_A.weight
        layer.pissa_initial = PiSSAInitial(
            layer.lora_A.weight.shape, layer.lora_B.weight.shape, weight.device, weight.dtype
        )

    @torch.no_grad()
    def initialize_from_base(self, layer: nn.Module) -> None:
        weight = full_weight(layer.base.weight.data).float()  # the whole weight on every rank: (out, in)
        rank = layer.lora_A.out_features
        U, S, Vh = torch.linalg.svd(weight, full_matrices=False)
        singular = (S[:rank] / layer.scaling).sqrt()
        lora_A = singular[:, None] * Vh[:rank]  # (r, in)
        lora_B = U[:, :rank] * singular[None, :]  # (out, r)
        initial = layer.pissa_initial
        initial.lora_A.copy_(lora_A)
        initial.lora_B.copy_(lora_B)
        for param, full in ((layer.lora_A.weight, lora_A), (layer.lora_B.weight, lora_B)):
            local, offset = rows_held(param.data)
            local.copy_(full[offset : offset + local.shape[0]])
        _set_residual(layer, weight)

    @torch.no_grad()
    def adapters_loaded(self, layer: nn.Module) -> None:
        _set_residual(layer, full_weight(layer.base.weight.data).float())

    def merged_weight(self, weight: torch.Tensor, adapters: ModuleAdapters, scaling: float) -> torch.Tensor:
        """W_res + s B A, W_res rebuilt as the run built it."""
        residual = weight - lora_delta(
            adapters[f"{INITIAL}.lora_A"], adapters[f"{INITIAL}.lora_B"], scaling
        ).to(weight.device)
        return super().merged_weight(residual, adapters, scaling)

    def peft_form(
        self, adapters: Mapping[str, torch.Tensor], lora: LoRAConfig
    ) -> tuple[Mapping[str, torch.Tensor], LoRAConfig]:
        converted = {}
        for name, tensor in adapters.items():
            if f".{INITIAL}." in name:
                continue
            module = name.rsplit(".", 2)[0]
            initial_A, initial_B = (
                adapters[f"{module}.{INITIAL}.lora_A"],
                adapters[f"{module}.{INITIAL}.lora_B"],
            )
            if name.endswith(".lora_A.weight"):
                converted[name] = torch.cat([tensor, initial_A.to(tensor.dtype)], dim=0)  # (2r, in)
            else:
                converted[name] = torch.cat([tensor, -initial_B.to(tensor.dtype)], dim=1)  # (out, 2r)
        return converted, replace(lora, rank=2 * lora.rank, alpha=2 * lora.alpha, variant="lora")


class PiSSAInitial(nn.Module):
    """A0 and B0, the adapter a PiSSA layer started from; buffers, not trained."""

    def __init__(
        self, shape_A: torch.Size, shape_B: torch.Size, device: torch.device | str | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.register_buffer("lora_A", torch.zeros(shape_A, device=device, dtype=dtype))
        self.register_buffer("lora_B", torch.zeros(shape_B, device=device, dtype=dtype))


def _set_residual(layer: nn.Module, weight: torch.Tensor) -> None:
    """The rows of `layer.base.weight` this rank holds := those of W - s B0 A0 (`weight`: the whole W, fp32)."""
    initial = layer.pissa_initial
    residual = weight - lora_delta(initial.lora_A, initial.lora_B, layer.scaling).to(weight.device)
    local, offset = rows_held(layer.base.weight.data)
    local.copy_(residual[offset : offset + local.shape[0]])


VARIANT = PiSSA()
