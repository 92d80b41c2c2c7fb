"""litsft/model/lora/config.py: the LoRA settings' defaults, derived values and the checks they make on themselves."""

from __future__ import annotations

import pytest

from litsft.errors import LitsftError
from litsft.model.lora.config import LoRAConfig


def test_defaults_spell_out_all_linear_and_scale_by_alpha_over_rank() -> None:
    assert LoRAConfig().target_list == ["q", "k", "v", "o", "gate", "up", "down"]
    assert LoRAConfig(rank=4, alpha=8).scaling == 2.0
    assert LoRAConfig(rank=4, alpha=8, variant="rslora").scaling == 4.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LoRAConfig(targets=["q", "qq"]), r"lora targets \['qq'\] are not valid"),
        (lambda: LoRAConfig(targets="all"), r"lora targets='all' is not valid"),
        (lambda: LoRAConfig(alpha=0), r"--lora.alpha=0"),
        (lambda: LoRAConfig(dropout=1.0), r"--lora.dropout=1.0"),
        (lambda: LoRAConfig(variant="qlora"), r"--lora.variant='qlora' is not valid"),
    ],
)
def test_bad_values_are_refused_with_the_option_named(make, message: str) -> None:
    with pytest.raises(LitsftError, match=message):
        make()
