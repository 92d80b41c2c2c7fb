"""LoRA: low-rank adapters on a frozen Transformer, and the math that folds them into base weights.

A projection `W` becomes `W x + B A dropout(x) * scaling`, with A (rank, in) and B (out, rank), dropout's
masks drawn per sample (`litsft.model.network.sample_dropout`); B starts at zero, so a fresh adapter leaves the
model's outputs unchanged. What differs between variants (their scaling, extra modules, initialization,
forward, merge, PEFT form and learning rates) is each variant's own module in litsft.model.lora.variants;
`LoRALinear` asks its variant and names none.

Parameter names. Each adapted `nn.Linear` is wrapped in a `LoRALinear` that keeps it as a child named `base`,
so FSDP2 can put the frozen base and the trainable adapters in separate units:

    blocks.0.attn.q_proj.weight   ->  blocks.0.attn.q_proj.base.weight     (frozen)
                                      blocks.0.attn.q_proj.lora_A.weight   (rank, in)
                                      blocks.0.attn.q_proj.lora_B.weight   (out, rank)
                                      blocks.0.attn.q_proj.<a variant's module>...  (e.g. DoRA's
                                                                           lora_magnitude_vector.weight)

A mixture of experts' fused expert weights (litsft.model.network.moe.GroupedExperts) get per-expert adapters, an
`ExpertLoRA` beside each weight, which the experts' forward runs on the same sorted token slices:

    blocks.0.mlp.experts.gate_up_proj  (E, 2I, C)  ->  blocks.0.mlp.experts.gate_up_lora.lora_A.weight (E, r, C)
                                                       blocks.0.mlp.experts.gate_up_lora.lora_B.weight (E, 2I, r)
    blocks.0.mlp.experts.down_proj     (E, C, I)   ->  blocks.0.mlp.experts.down_lora.lora_A.weight    (E, r, I)
                                                       blocks.0.mlp.experts.down_lora.lora_B.weight    (E, C, r)

`model.load_state_dict(plain_litsft_state_dict)` still works: `LoRALinear` renames `weight`/`bias` to
`base.weight`/`base.bias` while loading and leaves its adapters as they are when the state dict has none.

Which projections get adapters, and their size, is `litsft.model.lora.config.LoRAConfig`: a run setting, read by the
CLI without torch. The folder finetune_lora writes is `litsft.checkpoint.lora_folder`; merging it into a model
folder and exporting it to Hugging Face or PEFT is `litsft.huggingface.convert`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.lora.config import LORA_TARGETS, LoRAConfig
from litsft.model.lora.variants import VARIANT_NAMES, adapter_variant
from litsft.model.lora.variants.spec import lora_delta
from litsft.model.network.moe import GroupedExperts
from litsft.model.network.sample_dropout import SampleDropout
from litsft.model.network.transformer import Transformer

# Target -> the attribute name of the nn.Linear it adapts (the same name Hugging Face and PEFT use).
MODULE_OF_TARGET: dict[str, str] = {
    t: t if t == "lm_head" else f"{t}_proj" for t in LORA_TARGETS if t != "experts"
}
EXPERT_TARGETS = ("experts", "gate", "up", "down")
"""The targets that, on a mixture of experts, name its experts' fused projections."""
EXPERT_ADAPTERS: dict[str, str] = {"gate_up_proj": "gate_up_lora", "down_proj": "down_lora"}
"""A fused expert weight of GroupedExperts -> the name of the ExpertLoRA beside it."""


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


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update: base(x) + B(A(dropout(x))) * scaling, or what
    the adapter variant (`variant`, a name of litsft.model.lora.variants) makes of it."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float, scaling: float | None = None,
        variant: str = "lora", initialize: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        self.variant = adapter_variant(variant)
        # An NF4 base weight's dtype is the one it dequantizes to: the adapters' dtype too.
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = LoRAUp(rank, base.out_features, bias=False, **factory)
        self.variant.add_modules(self)
        self.dropout = SampleDropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = self.variant.scaling(alpha, rank) if scaling is None else scaling
        if initialize and base.weight.device.type != "meta":
            self.reset_lora_parameters()
        self.register_load_state_dict_pre_hook(_load_plain_names)

    adapters_enabled = True
    """False inside `adapters_disabled`: the base projection alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if not self.adapters_enabled:
            return result
        h = self.dropout(x)
        return result + self.variant.update(self, x, h, result)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """A as PEFT and the LoRA paper initialize it (nn.Linear's default), B zero, then what the variant
        derives from the base weight (DoRA's magnitude, PiSSA's singular vectors)."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.variant.initialize_from_base(self)

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling (out, in), in fp32."""
        return lora_delta(self.lora_A.weight, self.lora_B.weight, self.scaling)


class ExpertWeight(nn.Module):
    """One 3D adapter tensor, `weight` (E, rows, cols), as a module so that its name ends like LoRALinear's
    (`lora_A.weight`); `reset_parameters` draws A like each expert's nn.Linear would, and zeroes B."""

    def __init__(self, experts: int, rows: int, cols: int, zero: bool, **factory: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, rows, cols, **factory))  # type: ignore[arg-type]
        self.zero = zero
        if self.weight.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.zero:
            nn.init.zeros_(self.weight)
        else:
            bound = 1 / math.sqrt(self.weight.shape[-1])
            nn.init.uniform_(self.weight, -bound, bound)


class ExpertLoRA(nn.Module):
    """Per-expert LoRA on one fused expert weight (E, out, in): A (E, rank, in), B (E, out, rank), scaling
    alpha / rank. litsft.model.network.moe.GroupedExperts runs it as (x A_e^T * scaling) B_e^T per assignment."""

    def __init__(self, weight: torch.Tensor, rank: int, scaling: float) -> None:
        super().__init__()
        experts, out_features, in_features = weight.shape
        factory = dict(device=weight.device, dtype=weight.dtype)
        self.lora_A = ExpertWeight(experts, rank, in_features, zero=False, **factory)
        self.lora_B = ExpertWeight(experts, out_features, rank, zero=True, **factory)
        self.scaling = scaling

    def delta_weight(self) -> torch.Tensor:
        """B_e @ A_e * scaling for every expert (E, out, in), in fp32: for merging, never in the forward."""
        return lora_delta(self.lora_A.weight, self.lora_B.weight, self.scaling)


def _check_expert_targets(config: LoRAConfig, model_config: Config) -> bool:
    """Whether `config` adapts the experts of `model_config`; refuses, in one line, what cannot be done."""
    named = [t for t in EXPERT_TARGETS if t in config.target_list]
    if config.targets == "all-linear" or not named:
        return False
    if not model_config.num_experts:
        if "experts" in named:
            raise LitsftError(
                f"lora target 'experts': {model_config.name} is not a mixture of experts; "
                "name its MLP projections gate, up, down instead"
            )
        return False
    if ("gate" in named) != ("up" in named):
        raise LitsftError(
            f"lora targets {named}: {model_config.name}'s experts fuse gate and up into one projection; "
            "name both gate and up, or 'experts' for every expert projection"
        )
    if config.variant != "lora":
        raise LitsftError(
            f"--lora.variant {config.variant} does not adapt a mixture of experts' experts (plain LoRA does); "
            "pass --lora.variant lora, or leave gate, up, down and experts out of --lora.targets"
        )
    if config.dropout > 0:
        raise LitsftError(
            f"--lora.dropout {config.dropout}: adapters on {model_config.name}'s experts have no dropout; "
            "pass --lora.dropout 0, or leave gate, up, down and experts out of --lora.targets"
        )
    return True


def check_expert_targets(config: LoRAConfig, model_config: Config, quantize: str | None) -> None:
    """Refuse, in one line and before any process starts, expert targets litsft cannot train: with another
    variant than plain LoRA, with dropout, with a gate without its up, and under QLoRA, since torchao's NF4Tensor
    takes 1D and 2D weights only (`to_nf4` on an (E, out, in) weight fails with "expect input tensor dim <= 2")."""
    if _check_expert_targets(config, model_config) and quantize is not None:
        raise LitsftError(
            f"--quantize {quantize} with lora targets on {model_config.name}'s experts: torchao's NF4 stores "
            "2D weights only, not the fused 3D experts; drop --quantize, or leave the experts out of --lora.targets"
        )


def _load_plain_names(
    module: LoRALinear, state_dict: dict[str, torch.Tensor], prefix: str, *_: object
) -> None:
    """Accept `prefix.weight`/`prefix.bias` of a plain checkpoint as `prefix.base.weight`/`.base.bias`, and keep
    the current adapters when the state dict has none (load_state_dict hands the hook its own copy)."""
    for suffix in ("weight", "bias"):
        if prefix + suffix in state_dict:
            state_dict[prefix + "base." + suffix] = state_dict.pop(prefix + suffix)
    for name, tensor in module.state_dict().items():
        if _is_adapter_name(name):
            state_dict.setdefault(prefix + name, tensor)


# ---- applying to a model -------------------------------------------------------------------------------
def apply_lora(model: Transformer, config: LoRAConfig, initialize: bool = True) -> Transformer:
    """Wrap the targeted projections of `model` in LoRALinear (in place) and freeze everything but the
    adapters. On a model with its weights, fresh adapters are initialized from them (`initialize=False` leaves
    that to `load_adapters`). Works on a model on the meta device: after `to_empty()`, let Fabric's
    materialization call each module's `reset_parameters()` (or draw the adapters with
    `initial_adapter_value`), then load the base weights and call `initialize_from_base`."""
    adapter_variant(config.variant).check(config, model.config, None)
    adapt_experts = _check_expert_targets(config, model.config)
    module_names = {MODULE_OF_TARGET[t] for t in config.target_list if t != "experts"}
    for parent in list(model.modules()):
        if isinstance(parent, LoRALinear):
            continue
        if isinstance(parent, GroupedExperts):
            if adapt_experts:
                parent.gate_up_lora = ExpertLoRA(parent.gate_up_proj, config.rank, config.scaling)
                parent.down_lora = ExpertLoRA(parent.down_proj, config.rank, config.scaling)
            continue
        for name, child in list(parent.named_children()):
            if name in module_names and type(child) is nn.Linear:
                adapted = LoRALinear(
                    child,
                    config.rank,
                    config.alpha,
                    config.dropout,
                    config.scaling,
                    config.variant,
                    initialize,
                )
                setattr(parent, name, adapted)
    mark_only_lora_trainable(model)
    return model


def lora_layers(model: nn.Module) -> Iterator[LoRALinear]:
    """Every adapted projection of `model`."""
    return (module for module in model.modules() if isinstance(module, LoRALinear))


def initialize_from_base(model: nn.Module) -> None:
    """Finish fresh adapters once the base weights are loaded, as each variant needs (DoRA's magnitudes from
    the base's row norms, PiSSA's singular vectors and residual base). Collective on a sharded model."""
    for layer in lora_layers(model):
        layer.variant.initialize_from_base(layer)


@torch.no_grad()
def load_adapters(model: nn.Module, adapters: Mapping[str, torch.Tensor]) -> None:
    """Copy a run's saved adapters (litsft names) into `model`, a LoRA model over the original base weights
    (`apply_lora(..., initialize=False)`), and let each variant make it the model that run trained (PiSSA's
    residual base)."""
    for name, tensor in adapters.items():
        owner, _, attribute = name.rpartition(".")
        getattr(model.get_submodule(owner), attribute).copy_(tensor)
    for layer in lora_layers(model):
        layer.variant.adapters_loaded(layer)


def mark_only_lora_trainable(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad = _is_adapter_name(name)


ADAPTER_MODULES = ("lora_A", "lora_B") + tuple(
    module for variant in VARIANT_NAMES for module in adapter_variant(variant).extra_modules
)
"""The modules whose tensors are adapters: A, B and every variant's own."""


def _is_adapter_name(name: str) -> bool:
    return any(f".{adapter}." in f".{name}" for adapter in ADAPTER_MODULES)


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

    variant = adapter_variant(lora_config.variant)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter_state_dict.items():
        module, tensor_name = split_adapter_name(name)
        by_module.setdefault(module, {})[tensor_name] = tensor

    def merge(module: str, tensor: torch.Tensor) -> torch.Tensor:
        if module not in by_module:
            return tensor
        return variant.merged_weight(tensor.float(), by_module[module], lora_config.scaling).to(tensor.dtype)

    for name, tensor in base_tensors:
        module, _, suffix = name.rpartition(".")
        if suffix in EXPERT_ADAPTERS:  # a fused expert weight (E, out, in): B_e A_e added expert by expert
            yield name, merge(f"{module}.{EXPERT_ADAPTERS[suffix]}", tensor)
            continue
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


def split_adapter_name(name: str) -> tuple[str, str]:
    """`blocks.0.attn.q_proj.lora_A.weight` -> (`blocks.0.attn.q_proj`, `lora_A.weight`): the adapted module
    and the tensor's name under it."""
    parts = name.split(".")
    index = next(i for i, part in enumerate(parts) if part in ADAPTER_MODULES)
    return ".".join(parts[:index]), ".".join(parts[index:])


def base_weight_name(name: str) -> str | None:
    """Where a LoRA model's parameter lives in the plain base checkpoint, or None for an adapter."""
    if _is_adapter_name(name):
        return None
    return name.replace(".base.", ".")


def initial_adapter_value(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A fresh adapter drawn from `generator` alone, so it does not depend on how the model is sharded:
    A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (nn.Linear's default, PEFT's choice), B = 0, and a variant's own
    trained tensor (DoRA's magnitude) 1 until `initialize_from_base` sets it from the loaded base weights."""
    if name.endswith("lora_A.weight"):
        bound = 1 / math.sqrt(
            shape[-1]
        )  # the input features: (rank, in), or an expert adapter's (E, rank, in)
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    return torch.ones(shape)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it, `model` computes as its base model: every LoRA projection (LoRALinear) and expert adapter
    (GroupedExperts' gate_up_lora / down_lora) is skipped. A preference objective's live reference
    (--objective.reference live) is the base with its adapters off: no second copy of the model. Not the base
    for PiSSA, whose base weights are the residual of what it moved into the adapters."""
    switched = [m for m in model.modules() if isinstance(m, LoRALinear | GroupedExperts)]
    for module in switched:
        module.adapters_enabled = False
    try:
        yield
    finally:
        for module in switched:
            module.adapters_enabled = True
