"""rsLoRA, rank-stabilized LoRA (Kalajdzievski 2023, https://arxiv.org/abs/2312.03732): the update is scaled by
alpha / sqrt(r) instead of alpha / r, so its size no longer shrinks as the rank grows; PEFT's use_rslora."""

from __future__ import annotations

import math

from litsft.model.lora.variants.spec import AdapterVariant


class RsLoRA(AdapterVariant):
    def scaling(self, alpha: float, rank: int) -> float:
        return alpha / math.sqrt(rank)

    def alpha_for_rank_times(self, alpha: float, factor: int) -> float:
        return alpha * math.sqrt(factor)

    def peft_config(self) -> dict[str, object]:
        return {**super().peft_config(), "use_rslora": True}


VARIANT = RsLoRA()
