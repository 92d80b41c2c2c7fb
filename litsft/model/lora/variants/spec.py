"""What an adapter variant is: `AdapterVariant`, whose defaults are plain LoRA's, and the tensor helpers
that variants share. A variant module (litsft.model.lora.variants) subclasses it and overrides what it changes.

Every method gets the pieces it works on: a `LoRALinear` (litsft.model.lora.layers: `base`, `lora_A`, `lora_B`,
`dropout`, `scaling`, and the modules `add_modules` gave it), or an adapted module's tensors by their names
under it (`lora_A.weight`, `lora_B.weight`, and the variant's own, e.g. `lora_magnitude_vector.weight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from litsft.errors import LitsftError
from litsft.model.lora.variants import VARIANT_NAMES, adapter_variant

if TYPE_CHECKING:
    from litsft.model.config import Config
    from litsft.model.lora.config import LoRAConfig, Quantization

ModuleAdapters = Mapping[str, torch.Tensor]
"""One adapted module's tensors, named under it: {"lora_A.weight": (r, in), "lora_B.weight": (out, r), ...}."""


class AdapterVariant:
    """Plain LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685): W x + s B A dropout(x), s = alpha / r,
    A drawn like nn.Linear's weight, B zero, every adapter parameter at the run's learning rate."""

    extra_modules: tuple[str, ...] = ()
    """Names of the modules `add_modules` gives each LoRALinear besides lora_A and lora_B; their tensors are
    the variant's part of the adapters (saved in LoRA folders, checked against the model's shapes)."""
    peft_names: Mapping[str, str] = {}
    """A variant tensor's name in a PEFT adapter, by its litsft name under the module, when they differ."""
    options: tuple[str, ...] = ()
    """The LoRAConfig fields only this variant reads (None when not given); every other variant refuses them."""

    def scaling(self, alpha: float, rank: int) -> float:
        """The factor on B A."""
        return alpha / rank

    def alpha_for_rank_times(self, alpha: float, factor: int) -> float:
        """The alpha that keeps `scaling` when the rank is `factor` times larger (a PEFT module joining
        `factor` adapters)."""
        return alpha * factor

    def check(self, lora: LoRAConfig, config: Config, quantize: Quantization | None) -> None:
        """Refuse, in one line, settings this variant cannot train (before any process starts): here, an
        option that belongs to another variant."""
        for name in VARIANT_NAMES:
            owned = adapter_variant(name).options if name != lora.variant else ()
            for option in (option for option in owned if getattr(lora, option) is not None):
                raise LitsftError(
                    f"--lora.{option} applies to --lora.variant {name}, not {lora.variant}; "
                    f"drop it or pass --lora.variant {name}"
                )

    def add_modules(self, layer: nn.Module) -> None:
        """Give a new LoRALinear the variant's own modules (named in `extra_modules`)."""

    def initialize_from_base(self, layer: nn.Module) -> None:
        """Finish a fresh adapter once `layer.base` holds the loaded base weight (A and B are already drawn)."""

    def adapters_loaded(self, layer: nn.Module) -> None:
        """Adapters saved by a run were copied into `layer`, whose base holds the original base weight: make it
        the model that run trained."""

    def update(
        self, layer: nn.Module, x: torch.Tensor, h: torch.Tensor, result: torch.Tensor
    ) -> torch.Tensor:
        """What the adapter adds to the base output `result` = base(x); `h` is dropout(x)."""
        # Scaling the rank-wide intermediate costs out_features / rank times less than scaling the output.
        return layer.lora_B(layer.lora_A(h) * layer.scaling)

    def merged_weight(self, weight: torch.Tensor, adapters: ModuleAdapters, scaling: float) -> torch.Tensor:
        """The base weight (fp32) with the adapter folded in."""
        return weight + lora_delta(adapters["lora_A.weight"], adapters["lora_B.weight"], scaling).to(
            weight.device
        )

    def peft_form(
        self, adapters: Mapping[str, torch.Tensor], lora: LoRAConfig
    ) -> tuple[Mapping[str, torch.Tensor], LoRAConfig]:
        """The adapters (litsft names, every module) and settings a PEFT adapter for the original base holds."""
        return adapters, lora

    def peft_config(self) -> dict[str, object]:
        """This variant's keys of PEFT's adapter_config.json."""
        return {"use_rslora": False, "use_dora": False, "init_lora_weights": True}

    def lr_scale(self, lora: LoRAConfig, parameter_name: str) -> float:
        """The factor on the run's learning rate for the adapter parameter `parameter_name`."""
        return 1.0


# ---- tensors the variants share ------------------------------------------------------------------------
def lora_delta(lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """The weight update B @ A * scaling (out, in), computed in fp32 so a bf16 merge rounds only once."""
    return (lora_B.float() @ lora_A.float()) * scaling


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor: `weight` itself, or the values an NF4 weight stands for."""
    if hasattr(weight, "get_original_weight"):  # torchao's NF4Tensor
        return weight.get_original_weight()
    return weight


def rows_held(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the rows of `tensor` this rank holds, the first one's index): a DTensor's local rows, or all."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), offset[0]


def full_weight(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly FSDP2-sharded) weight on every rank; collective for a DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
