"""QLoRA's frozen base in 4 bits: the adapted projections of the blocks hold their weight as torchao's
NF4Tensor (4-bit NormalFloat with double-quantized scales, Dettmers et al. 2023,
https://arxiv.org/abs/2305.14314; torchao: https://github.com/pytorch/ao), a plain-PyTorch tensor subclass
that FSDP2 shards and all-gathers in its 4-bit form (its `fsdp_pre_all_gather` / `fsdp_post_all_gather`)
and that `F.linear` dequantizes on use. Weights are quantized from the checkpoint's values in fp32, the
dtype the model is built in, and dequantize to fp32 before the matmul casts them to the compute dtype.

Layout of one weight (torchao's `to_nf4`): every NF4_BLOCK_SIZE consecutive values (row-major) share an
absmax scale; the scales, minus their mean over the whole weight, are quantized to int8 with one fp scale
per NF4_SCALER_BLOCK_SIZE of them. So a weight costs 4 bits per value, plus 8 bits per 64 values, plus one
float per 16,384 values (NF4_BYTES_PER_WEIGHT), and the mean ties every row of a weight to every other.

Hence loading: each weight is read whole from the checkpoint (one tensor at a time, never the model),
quantized, and split into the rows this rank holds, so a shard's NF4 data are exactly those rows of the
unsharded quantization. torchao splits an NF4Tensor only at whole scale blocks, so every shard must hold a
multiple of 64 x 256 values (`check_nf4_shardable`).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.lora.config import Quantization

NF4_BLOCK_SIZE = 64
"""Values per absmax scale (QLoRA's and torchao's default)."""
NF4_SCALER_BLOCK_SIZE = 256
"""Scales per int8 scale factor in the double quantization (QLoRA's and torchao's default)."""
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCK_SIZE + 4 / (NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE)
"""4-bit code + int8 scale per block + fp32 factor per scale block (torchao keeps quantization_factor in the
weight's dtype; fp32 here)."""
QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of a block whose base weight is stored in NF4 once LoRA adapts them (never the
embeddings or the output head, as in QLoRA)."""


class NF4Linear(nn.Linear):
    """The frozen base of an adapted projection with its weight in NF4. Its forward is nn.Linear's:
    torchao's NF4Tensor turns `F.linear` into a matmul with the dequantized weight (`linear_nf4`)."""

    def reset_parameters(self) -> None:
        # The weight comes from the checkpoint (`load_nf4_weight`); nothing to draw.
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> NF4Linear:
        # torchao's empty_like (what `to_empty` runs) moves only the per-block data of an NF4Tensor and leaves
        # its lookup table and scales' mean on the meta device, where no later `.to(device)` can copy them
        # from: give them storage too, like every other materialized placeholder.
        result = super()._apply(fn, recurse)
        local = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if is_nf4(local) and local.nf4.is_meta and not local.quantized_data.is_meta:
            device = local.quantized_data.device
            local.nf4 = torch.empty_like(local.nf4, device=device)
            local.scaler_mean = torch.empty_like(local.scaler_mean, device=device)
        return result


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) quantized to torchao's NF4Tensor, in weight's dtype."""
    return torchao_nf4().to_nf4(weight.contiguous(), NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)


def torchao_nf4() -> ModuleType:
    """The torchao module that holds NF4 (`to_nf4`): torchao.quantization from torchao 0.18, torchao.dtypes
    before, as in 0.17.0, the release made for torch 2.11."""
    for name in ("torchao.quantization", "torchao.dtypes"):
        module = import_torchao(name)
        if hasattr(module, "to_nf4"):
            return module
    raise LitsftError("the installed torchao has no to_nf4 for --quantize nf4; install torchao 0.17 or newer")


@functools.cache
def import_torchao(module: str) -> ModuleType:
    """A torchao module (NF4 here, float8 in litsft.model.precision.float8), imported quietly: importing torchao logs a
    warning per CUDA kernel library it cannot load (on a CPU build) and one from torch's pytree about an enum
    it registers; neither NF4 nor float8 training needs those kernels."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def is_nf4(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def stored_bytes(tensor: torch.Tensor) -> float:
    """Bytes a (full, unsharded) tensor takes as stored: NF4_BYTES_PER_WEIGHT per value in NF4."""
    if is_nf4(tensor):
        return tensor.numel() * NF4_BYTES_PER_WEIGHT
    return tensor.numel() * tensor.element_size()


def quantized_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(name, base linear) of every adapted block projection that `quantize_base` stores in NF4."""
    from litsft.model.lora.layers import LoRALinear

    for name, module in model.named_modules():
        if isinstance(module, LoRALinear) and name.startswith("blocks.") and name.endswith(QUANTIZED_MODULES):
            yield f"{name}.base", module.base


def quantize_base(model: nn.Module, quantization: Quantization | None) -> nn.Module:
    """Store the base weight of every adapted block projection in NF4 (in place; on the meta device the
    weights are placeholders that `load_nf4_weight` replaces). None leaves the model as it is."""
    if quantization is None:
        return model
    for name, linear in list(quantized_linears(model)):
        nf4_linear = NF4Linear(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta"
        )
        nf4_linear.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
        if linear.bias is not None:
            nf4_linear.bias = linear.bias
        model.get_submodule(name.removesuffix(".base")).base = nf4_linear
    return model


@torch.no_grad()
def load_nf4_weight(module: nn.Module, full: torch.Tensor) -> None:
    """Give `module` (an NF4Linear, possibly FSDP2-sharded) the NF4 quantization of the whole weight `full`,
    keeping only this rank's rows: the shard is a split of the unsharded quantization, not a quantization of
    the rows alone (the scales' mean is the whole weight's)."""
    current = module.weight
    # Rebound, not kept beside: a checkpoint in another dtype (bf16) is not held while its copy quantizes.
    full = full.to(device=current.device, dtype=current.dtype)
    quantized = to_nf4(full)
    del full
    if isinstance(current, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(
            current.shape, current.device_mesh, current.placements
        )
        rows = local_shape[0]
        local = quantized.split(rows)[offset[0] // rows]
        # A DTensor over the NF4 rows with the current one's mesh and placements; FSDP2 picks the new
        # parameter up before the first forward (its lazy init resets the sharded parameters).
        quantized = DTensor(local, current._spec, requires_grad=False)
    module.weight = nn.Parameter(quantized, requires_grad=False)


def is_quantized_weight(name: str, adapters: Iterable[str]) -> bool:
    """Whether `quantize_base` stores the base checkpoint's tensor `name` in NF4 when the adapter tensors
    (litsft names) are `adapters`: the weight of an adapted block projection."""
    module, _, suffix = name.rpartition(".")
    return (
        suffix == "weight"
        and module.startswith("blocks.")
        and module.endswith(QUANTIZED_MODULES)
        and f"{module}.lora_A.weight" in adapters
    )


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 values an NF4 base weight held during training: `weight` quantized as finetune_lora
    quantizes it (in fp32, the dtype the model is built in) and dequantized."""
    return to_nf4(weight.float()).get_original_weight()


def iter_nf4_base(
    tensors: Iterable[tuple[str, torch.Tensor]], adapters: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A base checkpoint's tensors as a QLoRA run saw them: its quantized weights dequantized (fp32)."""
    adapters = set(adapters)
    for name, tensor in tensors:
        yield name, nf4_round_trip(tensor) if is_quantized_weight(name, adapters) else tensor


def check_nf4_shardable(config: Config, shard_group: int, targets: Iterable[str] = QUANTIZED_MODULES) -> None:
    """Refuse NF4 weights (the block projections among `targets`, LoRA target names) that are not a whole
    number of scale blocks, or that a shard group would split inside one (torchao can do neither)."""
    from litsft.model.accounting.sizes import model_sizes

    unit = NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE
    quantized = {target.removesuffix("_proj") for target in targets}
    for layer in model_sizes(config).layers:
        for target, (in_features, out_features) in layer.linear.items():
            if target not in quantized:
                continue
            if out_features % shard_group or (out_features // shard_group * in_features) % unit:
                split = f"split into {shard_group} shards of" if shard_group > 1 else "stored in"
                raise LitsftError(
                    f"--quantize nf4: {target}_proj's weight ({out_features} x {in_features}) cannot be {split} "
                    f"whole NF4 scale blocks ({unit} values each); use fewer devices per shard group, or "
                    "--fsdp.sharding_strategy NO_SHARD (or HYBRID_SHARD over several nodes)"
                    if shard_group > 1
                    else f"--quantize nf4: {target}_proj's weight ({out_features} x {in_features}) is not a "
                    f"whole number of NF4 scale blocks ({unit} values each); train this model without --quantize"
                )
