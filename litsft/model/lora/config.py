"""LoRA and QLoRA settings: which projections get adapters, their size and variant (one of litsft.model.lora.variants),
and how the frozen base is stored. Plain dataclasses with no torch, so the CLI parses `--lora.*` and `--quantize` without starting
anything heavy; `litsft.model.lora.layers` builds the adapters they describe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from litsft.errors import LitsftError, check_number
from litsft.model.lora.variants import VARIANT_NAMES, adapter_variant

Quantization = Literal["nf4"]
"""How finetune_lora stores the frozen base weights of the projections it adapts: nf4 is QLoRA's 4-bit
NormalFloat with double-quantized scales (litsft.model.precision.quantization)."""

LoRATarget = Literal["q", "k", "v", "o", "gate", "up", "down", "experts", "lm_head"]
LORA_TARGETS: tuple[str, ...] = get_args(LoRATarget)
LoRAVariant = Literal[VARIANT_NAMES]  # type: ignore[valid-type]  (the modules of litsft.model.lora.variants)
# PEFT's "all-linear" leaves the output layer out; so does litsft's.
ALL_LINEAR: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LoRAConfig:
    """Which projections get low-rank adapters, and their size."""

    rank: int = 8
    """Rank r of each adapter: A is (r, in_features), B is (out_features, r)."""
    alpha: float = 16
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.05
    """Dropout on the adapter's input during training. Each sample's masks come from the seed, the step and
    its place in the global batch, so one process and N give the same result, and so does a resume on
    another number of processes."""
    targets: list[LoRATarget] | Literal["all-linear"] = "all-linear"
    """Projections to adapt: a list of q, k, v, o, gate, up, down, experts, lm_head, or all-linear (every attention
    and MLP projection, not lm_head). Adapting the MLP too is what lets LoRA approach full fine-tuning
    (QLoRA, Dettmers et al. 2023), for a few more adapter parameters. On a mixture of experts all-linear is
    the attention projections; `experts` (or gate, up, down) adds per-expert adapters on every expert's fused
    gate_up projection (gate and up together) and its down projection (plain LoRA, no dropout, no QLoRA)."""
    variant: LoRAVariant = "lora"
    """The adapter variant, one module of litsft/model/lora/variants/ each: lora (scaling alpha / rank), or one that
    changes it, e.g. rslora (alpha / sqrt(rank)) or dora (a trained magnitude per weight row);
    tutorials/finetune_lora.md describes each."""
    loraplus_lr_ratio: float | None = None
    """LoRA+ (--lora.variant loraplus): B's learning rate over A's; default 16."""

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            if self.targets != "all-linear":
                raise LitsftError(
                    f"lora targets={self.targets!r} is not valid; use 'all-linear' or a list of {', '.join(LORA_TARGETS)}"
                )
        else:
            self.targets = list(self.targets)
            unknown = [t for t in self.targets if t not in LORA_TARGETS]
            if unknown or not self.targets:
                raise LitsftError(
                    f"lora targets {unknown or self.targets} are not valid; choose from {', '.join(LORA_TARGETS)} "
                    "or use 'all-linear'"
                )
        check_number("--lora.rank", self.rank, at_least=1, fix="use e.g. 8 or 16")
        check_number(
            "--lora.alpha", self.alpha, above=0,
            fix="the adapters' output is scaled by alpha / rank, so 0 trains nothing; use e.g. 2 x rank",
        )  # fmt: skip
        check_number("--lora.dropout", self.dropout, at_least=0, below=1, fix="use e.g. 0.05, or 0 for none")
        if self.variant not in VARIANT_NAMES:
            raise LitsftError(
                f"--lora.variant={self.variant!r} is not valid; choose one of {', '.join(VARIANT_NAMES)}"
            )
        if self.loraplus_lr_ratio is not None:
            check_number("--lora.loraplus_lr_ratio", self.loraplus_lr_ratio, above=0, fix="use e.g. 16")

    @property
    def target_list(self) -> list[str]:
        """The targets with all-linear spelled out."""
        return list(ALL_LINEAR) if self.targets == "all-linear" else list(self.targets)

    @property
    def scaling(self) -> float:
        """The factor on B A, as the variant defines it (alpha / rank; alpha / sqrt(rank) for rsLoRA). Imports
        the variant's module, and with it torch."""
        return adapter_variant(self.variant).scaling(self.alpha, self.rank)
