"""The adapter variants of litsft/model/lora/variants/: the registry, tests every variant passes (parametrized over
the registry, so a new variant module is covered at once), then a section per variant that needs its own."""

import copy
import json
from pathlib import Path
from typing import get_args

import peft
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_model_lora_layers import (
    TOKENS,
    base_model,
    load_checkpoint_model,
    logits_of,
    save_base_checkpoint,
    train,
)
from tiny_hf import save_tiny_hf, tiny_hf_model
from torch import nn
from transformers import AutoModelForCausalLM

from litsft.checkpoint.lora_folder import read_lora_folder, save_lora_folder
from litsft.checkpoint.model_loader import load_model
from litsft.errors import LitsftError
from litsft.huggingface.convert import convert_from_hf, export_lora_to_hf, export_peft_adapter, merge_lora
from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig, LoRAVariant
from litsft.model.lora.layers import LoRALinear, apply_lora, lora_state_dict
from litsft.model.lora.variants import VARIANT_NAMES, adapter_variant
from litsft.training.args import OptimizerConfig
from litsft.training.optimizer import build_optimizer, set_learning_rate

torch.set_num_threads(1)
ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "litsft" / "model" / "lora" / "variants"
ALL_LINEAR_AND_HEAD = ["q", "k", "v", "o", "gate", "up", "down", "lm_head"]


# ---- the registry --------------------------------------------------------------------------------------
def test_the_variants_are_the_modules_of_the_package_and_the_only_choices():
    modules = {path.stem for path in ADAPTERS_DIR.glob("*.py")} - {"__init__", "spec"}
    assert set(VARIANT_NAMES) == modules == {"lora", "rslora", "dora", "loraplus", "pissa"}
    assert VARIANT_NAMES[0] == "lora" and get_args(LoRAVariant) == VARIANT_NAMES
    with pytest.raises(LitsftError, match="choose one of lora, dora, loraplus, pissa, rslora$"):
        LoRAConfig(variant="vera")


def test_the_command_line_offers_the_registry_as_choices(capsys):
    from litsft.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["finetune_lora", "--help"])
    assert exit.value.code == 0
    assert "{lora,dora,loraplus,pissa,rslora}" in capsys.readouterr().out.replace(" ", "").replace("\n", "")


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
    # DoRA has no PEFT form on a fused module (refused, test_huggingface_convert_lora.py).
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


# ---- PiSSA ---------------------------------------------------------------------------------------------
class HandWrittenPiSSA(nn.Module):
    """PiSSA as the paper writes it (section 3): W = U S V^T, A = sqrt(S_r / s) V_r^T, B = U_r sqrt(S_r / s),
    the frozen residual W - s B A; y = W_res x + s B A x (+ bias)."""

    def __init__(self, linear: nn.Linear, rank: int, scaling: float) -> None:
        super().__init__()
        W = linear.weight.detach().float()
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        root = torch.diag(torch.sqrt(S[:rank] / scaling))
        self.A = nn.Parameter(root @ Vh[:rank])
        self.B = nn.Parameter(U[:, :rank] @ root)
        self.register_buffer("residual", W - scaling * self.B.detach() @ self.A.detach())
        self.bias, self.scaling = linear.bias, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.residual, self.bias) + self.scaling * F.linear(F.linear(x, self.A), self.B)


def test_one_pissa_step_equals_a_hand_written_reference():
    base = base_model(tied=False)
    reference = copy.deepcopy(base)
    lora = LoRAConfig(targets=["q", "v", "down", "lm_head"], variant="pissa", rank=4, alpha=8, dropout=0.0)
    model = apply_lora(base, lora)
    for param in reference.parameters():
        param.requires_grad = False
    for parent in list(reference.modules()):
        for name, child in list(parent.named_children()):
            if name in ("q_proj", "v_proj", "down_proj", "lm_head"):
                setattr(parent, name, HandWrittenPiSSA(child, rank=4, scaling=2.0))
    hand = [m for m in reference.modules() if isinstance(m, HandWrittenPiSSA)]
    ours = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(hand) == len(ours) == 2 * 3 + 1
    for h, o in zip(hand, ours):  # the same start: A, B and the residual base
        torch.testing.assert_close(o.lora_A.weight, h.A, atol=1e-6, rtol=0)
        torch.testing.assert_close(o.lora_B.weight, h.B, atol=1e-6, rtol=0)
        torch.testing.assert_close(o.base.weight, h.residual, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits_of(model), logits_of(reference), atol=1e-5, rtol=0)

    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(3))
    for network in (model, reference):
        optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad], lr=1e-2)
        logits = network(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
    for h, o in zip(hand, ours):
        torch.testing.assert_close(o.lora_A.weight, h.A, atol=1e-5, rtol=0)
        torch.testing.assert_close(o.lora_B.weight, h.B, atol=1e-5, rtol=0)
    stepped = logits_of(model)
    torch.testing.assert_close(stepped, logits_of(reference), atol=1e-5, rtol=0)
    assert (stepped - logits_of(base_model(tied=False))).abs().max() > 1e-3  # the step moved the model


def test_pissa_starts_where_peft_starts_and_exports_peft_s_conversion(tmp_path):
    """litsft's PiSSA initialization is PEFT's (`init_lora_weights="pissa"`) on the same weights; the PEFT export
    is PEFT's own PiSSA-to-LoRA conversion (`save_pretrained(path_initial_model_for_weight_conversion=...)`):
    rank 2r, alpha 2 alpha, loaded as a plain LoRA on the original base."""
    hf_model = tiny_hf_model("llama")
    save_tiny_hf(hf_model, tmp_path / "hf", tokenizer=False)
    convert_from_hf(tmp_path / "hf", tmp_path / "base")
    lora = LoRAConfig(targets=["q", "down"], rank=4, alpha=8, dropout=0.0, variant="pissa")
    model = apply_lora(load_checkpoint_model(tmp_path / "base"), lora)
    peft_config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights="pissa"
    )
    peft_model = peft.get_peft_model(copy.deepcopy(hf_model), peft_config)
    peft_q = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    ours = model.blocks[1].attn.q_proj
    torch.testing.assert_close(ours.lora_A.weight, peft_q.lora_A["default"].weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.lora_B.weight, peft_q.lora_B["default"].weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.base.weight, peft_q.base_layer.weight, atol=1e-6, rtol=0)

    # PEFT's conversion of the same adapters after the same training, done by PEFT.
    peft_model.save_pretrained(tmp_path / "peft-initial")
    train(model)
    with torch.no_grad():
        for name, tensor in lora_state_dict(model).items():
            if ".pissa_initial." in name:
                continue
            module, _, kind = name.rpartition(".lora_")
            peft_module = peft_model.base_model.model.get_submodule(_hf_module(module))
            getattr(peft_module, f"lora_{kind.removesuffix('.weight')}")["default"].weight.copy_(tensor)
    peft_model.save_pretrained(
        tmp_path / "peft-converted", path_initial_model_for_weight_conversion=str(tmp_path / "peft-initial")
    )
    save_lora_folder(lora_state_dict(model), lora, tmp_path / "base", tmp_path / "lora")
    export_peft_adapter(tmp_path / "lora", tmp_path / "peft")

    ours_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    theirs_config = json.loads((tmp_path / "peft-converted" / "adapter_config.json").read_text())
    for key in ("r", "lora_alpha", "init_lora_weights", "use_rslora", "use_dora"):
        assert ours_config[key] == theirs_config[key], key
    assert (ours_config["r"], ours_config["lora_alpha"]) == (8, 16)
    ours_tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    theirs_tensors = load_file(tmp_path / "peft-converted" / "adapter_model.safetensors")
    assert ours_tensors.keys() == theirs_tensors.keys()
    for name, tensor in ours_tensors.items():
        torch.testing.assert_close(tensor, theirs_tensors[name], atol=1e-6, rtol=0)
    loaded = peft.PeftModel.from_pretrained(tiny_hf_model("llama"), tmp_path / "peft").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, logits_of(model), atol=1e-5, rtol=0)


def _hf_module(litsft_module: str) -> str:
    """blocks.1.attn.q_proj -> model.layers.1.self_attn.q_proj (Llama's names), for the two targets used here."""
    return litsft_module.replace("blocks.", "model.layers.").replace(".attn.", ".self_attn.")


def test_pissa_refuses_an_nf4_base_and_a_tied_lm_head():
    pissa = adapter_variant("pissa")
    with pytest.raises(LitsftError) as err:
        pissa.check(LoRAConfig(variant="pissa"), Config.from_name("tiny-llama"), "nf4")
    assert str(err.value) == (
        "--lora.variant pissa with --quantize nf4 is not supported: PiSSA trains on the residual of the base "
        "weights, which would have to be quantized after the decomposition; drop --quantize or use "
        "--lora.variant lora"
    )
    tied = Config.from_name("tiny-llama", tie_word_embeddings=True)
    with pytest.raises(LitsftError, match="ties lm_head to the input embeddings"):
        apply_lora(base_model(tied=True), LoRAConfig(variant="pissa", targets=["q", "lm_head"]))
    pissa.check(LoRAConfig(variant="pissa", targets=["q"]), tied, None)  # without lm_head: fine
