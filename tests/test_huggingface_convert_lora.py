"""convert.py's LoRA side: merging a LoRA folder into a litsft model folder, exporting it to Hugging Face
merged or as a PEFT adapter, and the checks that the base is the one the adapters were trained on. The
LoRA folder itself (storage/lora_folder.py) is tested here too: these tests write and read it."""

import copy
import json
import math

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_lora_layers import (
    TOKENS,
    base_model,
    load_checkpoint_model,
    logits_of,
    save_base_checkpoint,
    train,
    trained_lora_checkpoint,
)
from tiny_hf import save_tiny_hf, tiny_hf_model
from transformers import AutoModelForCausalLM

from litsft.__main__ import main
from litsft.checkpoint.lora_folder import save_lora_folder
from litsft.checkpoint.model_folder import (
    WeightsFingerprint,
    iter_model_tensors,
    save_model_folder,
    weights_fingerprint,
)
from litsft.errors import LitsftError
from litsft.huggingface.convert import (
    convert_from_hf,
    convert_to_hf,
    export_lora_to_hf,
    export_peft_adapter,
    merge_lora,
)
from litsft.model.lora.layers import LoRAConfig, apply_lora, lora_state_dict

torch.set_num_threads(1)


@pytest.mark.parametrize("tied", [False, True])
def test_merge_lora_command_writes_equivalent_checkpoint(tmp_path, tied):
    model, lora_dir = trained_lora_checkpoint(tmp_path, tied, ["q", "v", "gate", "lm_head"])
    assert sorted(p.name for p in lora_dir.iterdir()) == [
        "adapter.safetensors",
        "lora_config.json",
        "tokenizer.json",
    ]
    assert json.loads((lora_dir / "lora_config.json").read_text()) == {
        "rank": 8,
        "alpha": 16,
        "dropout": 0.05,
        "targets": ["q", "v", "gate", "lm_head"],
        "variant": "lora",
        "base_checkpoint": str((tmp_path / "base").resolve()),
        "base_weights_sha256": weights_fingerprint(tmp_path / "base"),
    }
    assert load_file(lora_dir / "adapter.safetensors").keys() == lora_state_dict(model).keys()

    merge_lora(lora_dir)
    merged = load_checkpoint_model(lora_dir / "merged")
    torch.testing.assert_close(logits_of(merged), logits_of(model), atol=1e-5, rtol=0)
    assert merged.config.tie_word_embeddings is False
    assert (lora_dir / "merged" / "tokenizer.json").read_text() == '{"tiny": true}'

    main(["merge_lora", str(lora_dir), "--out_dir", str(tmp_path / "cli")])
    assert torch.equal(logits_of(load_checkpoint_model(tmp_path / "cli")), logits_of(merged))


ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down", "lm_head"]
LLAMA_MODULES = sorted(
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
)


@pytest.mark.parametrize(
    ("kind", "targets", "target_modules", "fused", "variant"),
    [
        ("llama", ALL_TARGETS, LLAMA_MODULES, {}, "lora"),
        ("llama-tied", ALL_TARGETS, LLAMA_MODULES, {}, "lora"),
        ("gemma2", ALL_TARGETS, LLAMA_MODULES, {}, "lora"),
        ("gemma3", ALL_TARGETS, LLAMA_MODULES, {}, "lora"),
        ("olmo2", ALL_TARGETS, LLAMA_MODULES, {}, "lora"),
        ("llama", ALL_TARGETS, LLAMA_MODULES, {}, "rslora"),
        ("llama", ALL_TARGETS, LLAMA_MODULES, {}, "dora"),
        ("llama-tied", ALL_TARGETS, LLAMA_MODULES, {}, "dora"),
        # Phi-3's fused modules, one of them adapted in part (q and v, not k): stacked A, block-diagonal B.
        ("phi3-longrope", ["q", "v", "gate", "up", "down", "lm_head"],
         ["down_proj", "gate_up_proj", "lm_head", "qkv_proj"], {"qkv_proj": 2, "gate_up_proj": 2}, "lora"),
        ("phi3-longrope", ["q", "v", "gate", "up", "down", "lm_head"],
         ["down_proj", "gate_up_proj", "lm_head", "qkv_proj"], {"qkv_proj": 2, "gate_up_proj": 2}, "rslora"),
    ],
)  # fmt: skip
def test_peft_adapter_reproduces_lora_model(tmp_path, kind, targets, target_modules, fused, variant):
    """The PEFT export, loaded by peft on the original transformers model, gives the LoRA model's logits and the
    merged export's (within 1e-5), also where one PEFT module holds several litsft adapters (Phi-3's qkv_proj),
    for LoRA, rsLoRA (use_rslora) and DoRA (use_dora)."""
    hf_model = tiny_hf_model(kind)
    save_tiny_hf(hf_model, tmp_path / "hf", tokenizer=False)
    convert_from_hf(tmp_path / "hf", tmp_path / "base")
    lora_config = LoRAConfig(targets=targets, alpha=24, variant=variant)
    model = apply_lora(load_checkpoint_model(tmp_path / "base"), lora_config)
    train(model)
    save_lora_folder(lora_state_dict(model), lora_config, tmp_path / "base", tmp_path / "lora")

    export_peft_adapter(tmp_path / "lora", tmp_path / "peft")
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    keys = ("peft_type", "task_type", "r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern")
    assert {k: peft_config[k] for k in (*keys, "use_rslora", "use_dora")} == {
        "use_rslora": variant == "rslora",
        "use_dora": variant == "dora",
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 24,
        "target_modules": target_modules,
        "rank_pattern": {module: n * 8 for module, n in fused.items()},
        "alpha_pattern": {
            module: 24 * math.sqrt(n) if variant == "rslora" else n * 24 for module, n in fused.items()
        },
    }
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "peft").eval()
    # PEFT saves exactly these names (plus, by default, a copy of the base lm_head, which is not needed).
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert saved.keys() == peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False).keys()
    assert f"base_model.model.model.layers.1.self_attn.{target_modules[-1]}.lora_A.weight" in saved
    assert "base_model.model.lm_head.lora_B.weight" in saved
    assert ("base_model.model.lm_head.lora_magnitude_vector" in saved) == (variant == "dora")
    with torch.no_grad():
        peft_logits = peft_model(TOKENS).logits
        with peft_model.disable_adapter():
            assert (peft_model(TOKENS).logits - peft_logits).abs().max() > 1e-3
    torch.testing.assert_close(peft_logits, logits_of(model), atol=1e-5, rtol=0)

    export_lora_to_hf(tmp_path / "lora", tmp_path / "merged-hf", format="merged")
    merged_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-hf").eval()
    with torch.no_grad():
        merged_logits = merged_hf(TOKENS).logits
        torch.testing.assert_close(merged_logits, logits_of(model), atol=1e-4, rtol=0)
    # The adapter on the original model is the merged model, to fp32 rounding.
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-5, rtol=0)


def test_missing_base_checkpoint_is_reported(tmp_path):
    _, lora_dir = trained_lora_checkpoint(tmp_path, False, ["q"])
    for path in (tmp_path / "base").iterdir():
        path.unlink()
    (tmp_path / "base").rmdir()
    with pytest.raises(LitsftError) as err:
        merge_lora(lora_dir, tmp_path / "out")
    assert str(err.value) == (
        f"base checkpoint {(tmp_path / 'base').resolve()} named in {lora_dir / 'lora_config.json'} does not "
        "exist; restore it there or edit base_checkpoint in that file"
    )
    assert not (tmp_path / "out").exists()


def test_adapter_that_does_not_fit_the_base_is_rejected(tmp_path):
    base = base_model(False)
    base_dir = save_base_checkpoint(base, tmp_path / "base")
    adapters = lora_state_dict(apply_lora(copy.deepcopy(base), LoRAConfig(rank=4, targets=["q"])))
    with pytest.raises(LitsftError) as err:
        save_lora_folder(adapters, LoRAConfig(rank=8, targets=["q"]), base_dir, tmp_path / "lora")
    assert str(err.value) == (
        "adapter state dict: tensor 'blocks.0.attn.q_proj.lora_A.weight' has shape (4, 64) but tiny-llama "
        "with rank 8 needs (8, 64); the adapter belongs to a different base checkpoint"
    )
    with pytest.raises(LitsftError) as err:
        save_lora_folder(adapters, LoRAConfig(rank=4, targets=["v"]), base_dir, tmp_path / "lora")
    assert str(err.value) == (
        "adapter state dict: tensor 'blocks.0.attn.q_proj.lora_A.weight' is not an adapter of tiny-llama "
        "with targets ['v']; the adapter belongs to a different model or LoRA config"
    )
    assert not (tmp_path / "lora").exists()


def changed_base_message(tmp_path, lora_dir, now: str) -> str:
    recorded = json.loads((lora_dir / "lora_config.json").read_text())["base_weights_sha256"]
    return (
        f"the weights in {(tmp_path / 'base').resolve()} changed since the adapters in {lora_dir} were trained "
        f"on them (fingerprint {now[:12]}, recorded {recorded[:12]}); restore the base checkpoint they were "
        f"trained on, or point base_checkpoint in {lora_dir / 'lora_config.json'} at a copy of it"
    )


def test_a_base_converted_again_with_other_weights_is_refused(tmp_path):
    _, lora_dir = trained_lora_checkpoint(tmp_path, False, ["q", "v"])
    other = base_model(False)
    with torch.no_grad():
        other.blocks[0].attn.q_proj.weight.add_(0.01)
    for path in (tmp_path / "base").iterdir():
        path.unlink()
    save_base_checkpoint(other, tmp_path / "base")
    expected = changed_base_message(tmp_path, lora_dir, weights_fingerprint(tmp_path / "base"))
    exports = {
        "merge_lora": lambda out: merge_lora(lora_dir, out),
        "merged HF": lambda out: export_lora_to_hf(lora_dir, out, "merged"),
        "PEFT": lambda out: export_lora_to_hf(lora_dir, out, "peft"),
    }
    for name, export in exports.items():
        with pytest.raises(LitsftError) as err:
            export(tmp_path / "out")
        assert str(err.value) == expected, name
        assert not (tmp_path / "out").exists(), name


def test_weights_edited_in_place_are_refused_before_publishing(tmp_path):
    """The manifest still matches; the bytes do not. Merging reads every weight, so it notices."""
    _, lora_dir = trained_lora_checkpoint(tmp_path, False, ["q"])
    weights = tmp_path / "base" / "model.safetensors"
    tensors = load_file(weights)
    tensors["norm.weight"] = tensors["norm.weight"] * 1.5
    save_file(tensors, weights, metadata={"format": "pt"})
    streamed = WeightsFingerprint()
    for name, tensor in iter_model_tensors(tmp_path / "base"):
        streamed.add(name, tensor)
    assert streamed.hexdigest() != weights_fingerprint(tmp_path / "base")  # what the manifest says
    with pytest.raises(LitsftError) as err:
        merge_lora(lora_dir, tmp_path / "out")
    assert str(err.value) == changed_base_message(tmp_path, lora_dir, streamed.hexdigest())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "lora"]


@pytest.mark.parametrize("tied", [False, True])
def test_peft_export_names_a_base_that_auto_peft_loads(tmp_path, tied):
    """From a base converted from a local HF directory, base_model_name_or_path is that directory; from a
    base that never was a HF checkpoint, the export writes the base next to the adapter and names it."""
    hf_model = tiny_hf_model("llama-tied" if tied else "llama")
    save_tiny_hf(hf_model, tmp_path / "hf", tokenizer=False)
    convert_from_hf(tmp_path / "hf", tmp_path / "converted")
    lora_config = LoRAConfig(targets=["q", "v", "down"])
    model = apply_lora(load_checkpoint_model(tmp_path / "converted"), lora_config)
    train(model)
    expected = logits_of(model)
    save_lora_folder(lora_state_dict(model), lora_config, tmp_path / "converted", tmp_path / "lora")
    # The same weights in a folder with no Hugging Face origin (as finetune_full writes).
    base = load_checkpoint_model(tmp_path / "converted")
    save_model_folder(base.state_dict().items(), base.config, tmp_path / "trained")
    save_lora_folder(lora_state_dict(model), lora_config, tmp_path / "trained", tmp_path / "lora-trained")

    convert_to_hf(tmp_path / "lora", tmp_path / "peft", lora_format="peft")
    convert_to_hf(tmp_path / "lora-trained", tmp_path / "peft-trained", lora_format="peft")
    for out_dir, base_path in (
        (tmp_path / "peft", tmp_path / "hf"),
        (tmp_path / "peft-trained", tmp_path / "peft-trained" / "base"),
    ):
        config = json.loads((out_dir / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base_path.resolve())
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained(out_dir).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(TOKENS).logits, expected, atol=1e-4, rtol=0)
    assert not (tmp_path / "peft" / "base").exists()
