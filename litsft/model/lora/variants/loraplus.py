"""LoRA+ (Hayou et al. 2024, https://arxiv.org/abs/2402.12354): plain LoRA whose B matrices train at a higher
learning rate than the A matrices, lr x `--lora.loraplus_lr_ratio` (default 16, the ratio the paper
recommends for most tasks, section 4), which the paper finds speeds fine-tuning up and improves it. Only the
training differs: adapters, merges and PEFT exports are plain LoRA's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from litsft.model.lora.variants.spec import AdapterVariant

if TYPE_CHECKING:
    from litsft.model.lora.config import LoRAConfig

DEFAULT_LR_RATIO = 16.0


class LoRAPlus(AdapterVariant):
    options = ("loraplus_lr_ratio",)

    def lr_scale(self, lora: LoRAConfig, parameter_name: str) -> float:
        if not parameter_name.endswith("lora_B.weight"):
            return 1.0
        return DEFAULT_LR_RATIO if lora.loraplus_lr_ratio is None else lora.loraplus_lr_ratio


VARIANT = LoRAPlus()
