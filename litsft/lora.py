"""LoRA: low-rank adapters on a frozen Transformer, and the math that folds them into base weights.

A projection `W` becomes `W x + B A dropout(x) * alpha / rank`, with A (rank, in) and B (out, rank); B starts
at zero, so a fresh adapter leaves the model's outputs unchanged.

Parameter names. Each adapted `nn.Linear` is wrapped in a `LoRALinear` that keeps it as a child named `base`,
so FSDP2 can put the frozen base and the trainable adapters in separate units:

    blocks.0.attn.q_proj.weight   ->  blocks.0.attn.q_proj.base.weight     (frozen)
                                      blocks.0.attn.q_proj.lora_A.weight   (rank, in)
                                      blocks.0.attn.q_proj.lora_B.weight   (out, rank)

`model.load_state_dict(plain_litsft_state_dict)` still works: `LoRALinear` renames `weight`/`bias` to
`base.weight`/`base.bias` while loading and leaves its adapters as they are when the state dict has none.

Which projections get adapters, and their size, is `litsft.args.LoRAConfig`: a run setting, read by the
CLI without torch. The folder finetune_lora writes is `litsft.storage.lora_folder`; merging it into a model
folder and exporting it to Hugging Face or PEFT is `litsft.convert`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

import torch
from torch import nn

from litsft.args import LORA_TARGETS, LoRAConfig
from litsft.config import Config
from litsft.errors import LitsftError
from litsft.model import Transformer

# Target -> the attribute name of the nn.Linear it adapts (the same name Hugging Face and PEFT use).
MODULE_OF_TARGET: dict[str, str] = {t: t if t == "lm_head" else f"{t}_proj" for t in LORA_TARGETS}


class LoRAUp(nn.Linear):
    """lora_B, (out, rank): `reset_parameters()` zeroes it, so Fabric materializing a meta-device model (which
    calls `reset_parameters()` on every module holding parameters) gives a fresh adapter, not a random one.
    Its forward is a plain linear layer with a backward pass suited to its rank-wide input (`NarrowInputLinear`)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return NarrowInputLinear.apply(h, self.weight)


class NarrowInputLinear(torch.autograd.Function):
    """h @ weight.T for an input h (..., r) only r (the LoRA rank) wide.

    Autograd's linear computes the gradients as grad @ weight (..., r) and grad.T @ h (out, r): products whose
    output is r columns wide, which BLAS on a CPU runs 3-4x slower than the same products transposed
    (measured: 0.59 ms against 0.20 ms for 2048 tokens, rank 8, 352 outputs). This backward computes the
    transposed products and returns transposed views; the values are the same.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, h: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        return h @ weight.t()

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        h, weight = ctx.saved_tensors
        # Under autocast the forward ran in a lower precision than the fp32 weight; the backward uses that one.
        grad = grad.flatten(0, -2)
        h_flat = h.flatten(0, -2).to(grad.dtype)
        grad_h = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_h = (weight.to(grad.dtype).t() @ grad.t()).t().reshape(h.shape).to(h.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (h_flat.t() @ grad).t().to(weight.dtype)
        return grad_h, grad_weight


class AdapterDropout(nn.Dropout):
    """nn.Dropout with a cheaper keep-mask on the CPU.

    torch's CPU dropout draws a Bernoulli sample per element (bernoulli_ was 15% of a LoRA step on this
    project's CPU benchmark). Here each random 64-bit draw gives two 31-bit integers, each compared with
    p * 2^31: the same dropout, with p exact to 2^-31, at about 3/4 of the cost. On a GPU torch's own kernel
    is used. The draws come from torch's default generator, so seeding and resuming work as before.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu":
            return super().forward(x)
        bits = torch.empty((x.numel() + 1) // 2, dtype=torch.int64).random_()  # uniform in [0, 2^63)
        halves = bits.view(torch.int32)[: x.numel()].view(x.shape).bitwise_and_(0x7FFFFFFF)  # 31 uniform bits
        threshold = round(self.p * 2**31)
        keep_scale = (halves >= threshold).to(x.dtype).mul_(2**31 / (2**31 - threshold))
        return x * keep_scale


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update: base(x) + B(A(dropout(x))) * alpha / rank."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base = base
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = LoRAUp(rank, base.out_features, bias=False, **factory)
        self.dropout = AdapterDropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        if base.weight.device.type != "meta":
            self.reset_lora_parameters()
        self.register_load_state_dict_pre_hook(_load_plain_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Scaling the rank-wide intermediate costs out_features / rank times less than scaling the output.
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x)) * self.scaling)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """A as PEFT and the LoRA paper initialize it (nn.Linear's default), B zero."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling (out, in), in fp32."""
        return lora_delta(self.lora_A.weight, self.lora_B.weight, self.scaling)


def _load_plain_names(
    module: LoRALinear, state_dict: dict[str, torch.Tensor], prefix: str, *_: object
) -> None:
    """Accept `prefix.weight`/`prefix.bias` of a plain checkpoint as `prefix.base.weight`/`.base.bias`, and keep
    the current adapters when the state dict has none (load_state_dict hands the hook its own copy)."""
    for suffix in ("weight", "bias"):
        if prefix + suffix in state_dict:
            state_dict[prefix + "base." + suffix] = state_dict.pop(prefix + suffix)
    for name in ("lora_A", "lora_B"):
        state_dict.setdefault(f"{prefix}{name}.weight", getattr(module, name).weight)


def lora_delta(lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """The weight update B @ A * scaling (out, in), computed in fp32 so a bf16 merge rounds only once."""
    return (lora_B.float() @ lora_A.float()) * scaling


# ---- applying to a model -------------------------------------------------------------------------------
def apply_lora(model: Transformer, config: LoRAConfig) -> Transformer:
    """Wrap the targeted projections of `model` in LoRALinear (in place) and freeze everything but the
    adapters. Works on a model on the meta device: after `to_empty()`, let Fabric's materialization
    call each module's `reset_parameters()` (or draw the adapters with `initial_adapter_value`), then load the
    base weights."""
    module_names = {MODULE_OF_TARGET[t] for t in config.target_list}
    for parent in list(model.modules()):
        if isinstance(parent, LoRALinear):
            continue
        for name, child in list(parent.named_children()):
            if name in module_names and type(child) is nn.Linear:
                setattr(parent, name, LoRALinear(child, config.rank, config.alpha, config.dropout))
    mark_only_lora_trainable(model)
    return model


def mark_only_lora_trainable(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad = _is_adapter_name(name)


def _is_adapter_name(name: str) -> bool:
    return ".lora_A." in f".{name}" or ".lora_B." in f".{name}"


def lora_state_dict(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a LoRA model, or of its (gathered) state dict, as full tensors in litsft names.
    With an FSDP2-sharded model every rank must call it: gathering a sharded tensor is a collective."""
    if isinstance(model_or_state_dict, nn.Module):
        model_or_state_dict = model_or_state_dict.state_dict()
    adapters = {}
    for name, tensor in model_or_state_dict.items():
        if _is_adapter_name(name):
            if hasattr(tensor, "full_tensor"):  # a DTensor shard
                tensor = tensor.full_tensor()
            # torch.compile wraps modules as `_orig_mod`; the saved names must not depend on it.
            adapters[name.replace("_orig_mod.", "")] = tensor.detach()
    return adapters


# ---- merging -------------------------------------------------------------------------------------------
def iter_merged_tensors(
    base_tensors: Iterable[tuple[str, torch.Tensor]],
    adapter_state_dict: Mapping[str, torch.Tensor],
    lora_config: LoRAConfig,
    tie_word_embeddings: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merge one base tensor at a time, so merging a 70B model holds one weight in memory, not the model.
    With tied embeddings and an lm_head adapter, `lm_head.weight` (embeddings + update) follows `embed.weight`;
    the merged checkpoint is then untied (see `merged_config`)."""

    def merge(module: str, tensor: torch.Tensor) -> torch.Tensor:
        lora_A = adapter_state_dict.get(f"{module}.lora_A.weight")
        if lora_A is None:
            return tensor
        delta = lora_delta(lora_A, adapter_state_dict[f"{module}.lora_B.weight"], lora_config.scaling)
        return (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)

    for name, tensor in base_tensors:
        module, _, suffix = name.rpartition(".")
        yield name, merge(module, tensor) if suffix == "weight" else tensor
        if name == "embed.weight" and tie_word_embeddings and "lm_head.lora_A.weight" in adapter_state_dict:
            yield "lm_head.weight", merge("lm_head", tensor)


def merged_config(config: Config, lora_config: LoRAConfig) -> Config:
    """The base config, untied when lm_head has an adapter: the merged lm_head no longer equals the embeddings."""
    if config.tie_word_embeddings and "lm_head" in lora_config.target_list:
        return replace(config, tie_word_embeddings=False)
    return config


# ---- checking adapters against a model -----------------------------------------------------------------
def check_adapter_shapes(
    adapters: Mapping[str, torch.Tensor], config: Config, lora_config: LoRAConfig, source: str
) -> None:
    """Raise LitsftError unless `adapters` holds exactly the tensors, and shapes, that `lora_config` gives `config`."""
    with torch.device("meta"):
        expected = {
            name: tuple(t.shape)
            for name, t in lora_state_dict(apply_lora(Transformer(config), lora_config)).items()
        }
    for name, tensor in adapters.items():
        if name not in expected:
            raise LitsftError(
                f"{source}: tensor {name!r} is not an adapter of {config.name} with targets "
                f"{lora_config.targets!r}; the adapter belongs to a different model or LoRA config"
            )
        if tuple(tensor.shape) != expected[name]:
            raise LitsftError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)} but {config.name} with rank "
                f"{lora_config.rank} needs {expected[name]}; the adapter belongs to a different base checkpoint"
            )
    missing = sorted(set(expected) - set(adapters))
    if missing:
        raise LitsftError(
            f"{source}: {len(missing)} adapter tensors are missing, e.g. {missing[0]!r}; the LoRA checkpoint is incomplete"
        )


def base_weight_name(name: str) -> str | None:
    """Where a LoRA model's parameter lives in the plain base checkpoint, or None for an adapter."""
    if _is_adapter_name(name):
        return None
    return name.replace(".base.", ".")


def initial_adapter_value(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A fresh adapter drawn from `generator` alone, so it does not depend on how the model is sharded:
    A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (nn.Linear's default, PEFT's choice), B = 0."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    bound = 1 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound
