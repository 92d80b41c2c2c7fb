"""The adapter variants of litsft/model/adapters/: the registry, tests every variant passes (parametrized over
the registry, so a new variant module is covered at once), then a section per variant that needs its own."""

from pathlib import Path
from typing import get_args

import peft
import pytest
import torch
from test_model_lora import TOKENS, base_model, load_checkpoint_model, logits_of, save_base_checkpoint, train
from tiny_hf import save_tiny_hf, tiny_hf_model
from transformers import AutoModelForCausalLM

from litsft.checkpoint.convert import convert_from_hf, export_lora_to_hf, export_peft_adapter, merge_lora
from litsft.checkpoint.lora_folder import read_lora_folder, save_lora_folder
from litsft.errors import LitsftError
from litsft.inference.generate import load_model
from litsft.model.adapters import VARIANT_NAMES
from litsft.model.lora import apply_lora, lora_state_dict
from litsft.model.lora_config import LoRAConfig, LoRAVariant

torch.set_num_threads(1)
ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "litsft" / "model" / "adapters"
ALL_LINEAR_AND_HEAD = ["q", "k", "v", "o", "gate", "up", "down", "lm_head"]


# ---- the registry --------------------------------------------------------------------------------------
def test_the_variants_are_the_modules_of_the_package_and_the_only_choices():
    modules = {path.stem for path in ADAPTERS_DIR.glob("*.py")} - {"__init__", "spec"}
    assert set(VARIANT_NAMES) == modules == {"lora", "rslora", "dora"}
    assert VARIANT_NAMES[0] == "lora" and get_args(LoRAVariant) == VARIANT_NAMES
    with pytest.raises(LitsftError, match="choose one of lora, dora, rslora$"):
        LoRAConfig(variant="vera")


def test_the_command_line_offers_the_registry_as_choices(capsys):
    from litsft.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["finetune_lora", "--help"])
    assert exit.value.code == 0
    assert "{lora,dora,rslora}" in capsys.readouterr().out.replace(" ", "").replace("\n", "")


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_every_variant_starts_as_the_base_trains_merges_and_loads_as_trained(tmp_path, variant):
    """A fresh adapter leaves the logits as they were (PiSSA: to rounding, its base being the residual), the
    merged checkpoint and `litsft generate`'s model (adapters on the original base) equal the trained model."""
    base = base_model(tied=False)
    base_dir = save_base_checkpoint(base, tmp_path / "base")
    expected = logits_of(base)
    lora = LoRAConfig(targets=["q", "v", "down", "lm_head"], variant=variant, rank=4, alpha=8)
    model = apply_lora(base, lora).eval()  # the new adapters' dropout too (PiSSA's B is not zero)
    torch.testing.assert_close(logits_of(model), expected, atol=1e-5, rtol=0)
    train(model)
    trained = logits_of(model)
    assert (trained - expected).abs().max() > 1e-3

    save_lora_folder(lora_state_dict(model), lora, base_dir, tmp_path / "lora")
    assert read_lora_folder(tmp_path / "lora").config == lora
    merge_lora(tmp_path / "lora")
    torch.testing.assert_close(
        logits_of(load_checkpoint_model(tmp_path / "lora" / "merged")), trained, atol=1e-5, rtol=0
    )
    loaded = load_model(tmp_path / "lora", torch.device("cpu"), torch.float32)
    torch.testing.assert_close(logits_of(loaded), trained, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("variant", "kind"),
    # DoRA has no PEFT form on a fused module (refused, test_checkpoint_convert_lora.py).
    [
        (v, kind)
        for v in VARIANT_NAMES
        for kind in ("llama", "phi3-longrope")
        if (v, kind) != ("dora", "phi3-longrope")
    ],
)
def test_every_variant_exports_a_peft_adapter_for_the_original_base(tmp_path, variant, kind):
    """The PEFT export, loaded by peft on the original transformers model (for PiSSA too: its residual base is
    not what peft loads it on), gives the trained model's logits, also on Phi-3's fused qkv_proj / gate_up_proj;
    so does the merged export."""
    # Phi-3's q and v share qkv_proj with an unadapted k; its lm_head is tied (PiSSA refuses that one).
    targets = ALL_LINEAR_AND_HEAD if kind == "llama" else ["q", "v", "gate", "up", "down"]
    hf_model = tiny_hf_model(kind)
    save_tiny_hf(hf_model, tmp_path / "hf", tokenizer=False)
    convert_from_hf(tmp_path / "hf", tmp_path / "base")
    lora = LoRAConfig(targets=targets, alpha=24, variant=variant)
    model = apply_lora(load_checkpoint_model(tmp_path / "base"), lora)
    train(model)
    save_lora_folder(lora_state_dict(model), lora, tmp_path / "base", tmp_path / "lora")

    export_peft_adapter(tmp_path / "lora", tmp_path / "peft")
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "peft").eval()
    with torch.no_grad():
        peft_logits = peft_model(TOKENS).logits
    torch.testing.assert_close(peft_logits, logits_of(model), atol=1e-5, rtol=0)
    export_lora_to_hf(tmp_path / "lora", tmp_path / "merged-hf", format="merged")
    merged_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged_hf(TOKENS).logits, logits_of(model), atol=1e-4, rtol=0)
