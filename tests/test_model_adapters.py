"""The adapter variants of litsft/model/adapters/: the registry, tests every variant passes (parametrized over
the registry, so a new variant module is covered at once), then a section per variant that needs its own."""

import copy
from pathlib import Path
from typing import get_args

import peft
import pytest
import torch
import torch.nn.functional as F
from test_model_lora import TOKENS, base_model, load_checkpoint_model, logits_of, save_base_checkpoint, train
from tiny_hf import save_tiny_hf, tiny_hf_model
from transformers import AutoModelForCausalLM

from litsft.checkpoint.convert import convert_from_hf, export_lora_to_hf, export_peft_adapter, merge_lora
from litsft.checkpoint.lora_folder import read_lora_folder, save_lora_folder
from litsft.errors import LitsftError
from litsft.inference.generate import load_model
from litsft.model.adapters import VARIANT_NAMES, adapter_variant
from litsft.model.config import Config
from litsft.model.lora import apply_lora, lora_state_dict
from litsft.model.lora_config import LoRAConfig, LoRAVariant
from litsft.training.args import OptimizerConfig
from litsft.training.optimizer import build_optimizer, set_learning_rate

torch.set_num_threads(1)
ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "litsft" / "model" / "adapters"
ALL_LINEAR_AND_HEAD = ["q", "k", "v", "o", "gate", "up", "down", "lm_head"]


# ---- the registry --------------------------------------------------------------------------------------
def test_the_variants_are_the_modules_of_the_package_and_the_only_choices():
    modules = {path.stem for path in ADAPTERS_DIR.glob("*.py")} - {"__init__", "spec"}
    assert set(VARIANT_NAMES) == modules == {"lora", "rslora", "dora", "loraplus"}
    assert VARIANT_NAMES[0] == "lora" and get_args(LoRAVariant) == VARIANT_NAMES
    with pytest.raises(LitsftError, match="choose one of lora, dora, loraplus, rslora$"):
        LoRAConfig(variant="vera")


def test_the_command_line_offers_the_registry_as_choices(capsys):
    from litsft.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["finetune_lora", "--help"])
    assert exit.value.code == 0
    assert "{lora,dora,loraplus,rslora}" in capsys.readouterr().out.replace(" ", "").replace("\n", "")


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


@pytest.mark.parametrize("variant", [v for v in VARIANT_NAMES if v != "loraplus"])
def test_a_variant_option_given_to_another_variant_is_refused(variant):
    lora = LoRAConfig(variant=variant, loraplus_lr_ratio=4)
    with pytest.raises(LitsftError) as err:
        adapter_variant(variant).check(lora, Config.from_name("tiny-llama"), None)
    assert str(err.value) == (
        f"--lora.loraplus_lr_ratio applies to --lora.variant loraplus, not {variant}; "
        "drop it or pass --lora.variant loraplus"
    )


# ---- LoRA+ ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [None, 4.0])
def test_one_loraplus_step_equals_torch_adamw_with_two_parameter_groups(ratio):
    """LoRA+: build_optimizer's groups and the schedule's learning rate (set_learning_rate, as the engine
    calls it) give exactly the step of torch's AdamW with A at lr and B at lr x ratio (default 16)."""
    lora = LoRAConfig(
        targets=["q", "v", "down"], variant="loraplus", rank=4, alpha=8, dropout=0.0, loraplus_lr_ratio=ratio
    )
    model = apply_lora(base_model(tied=False), lora)
    with torch.no_grad():  # B != 0, so that A has a gradient too
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(std=0.1)
    reference = copy.deepcopy(model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6)
    variant = adapter_variant("loraplus")
    optimizer = build_optimizer(model, config, lambda name: variant.lr_scale(lora, name))
    scheduled_lr = 4e-4  # what the schedule gives at some step
    set_learning_rate(optimizer, scheduled_lr)

    trained = {name: p for name, p in reference.named_parameters() if p.requires_grad}
    ratio_used = 16.0 if ratio is None else ratio
    reference_optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in trained.items() if n.endswith("lora_A.weight")], "lr": scheduled_lr},
            {
                "params": [p for n, p in trained.items() if n.endswith("lora_B.weight")],
                "lr": scheduled_lr * ratio_used,
            },
        ],
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True,  # the kernel build_optimizer uses on the CPU: same arithmetic, so equal to the bit
    )
    assert sorted(group["lr"] for group in optimizer.param_groups) == [
        scheduled_lr,
        scheduled_lr * ratio_used,
    ]
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(3))
    for network, opt in ((model, optimizer), (reference, reference_optimizer)):
        logits = network(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
    after = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, after[name]), name
        assert torch.equal(param, before[name]) != (name in trained), (
            name
        )  # the adapters, and only they, moved
