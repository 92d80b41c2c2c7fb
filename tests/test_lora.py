import copy
import json
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
from jsonargparse import CLI
from safetensors.torch import load_file
from tiny_hf import save_tiny_hf, tiny_hf_model
from transformers import AutoModelForCausalLM

from litsft.__main__ import main
from litsft.config import Config
from litsft.convert import convert_from_hf
from litsft.errors import LitsftError
from litsft.lora import (
    AdapterDropout,
    LoRAConfig,
    LoRALinear,
    NarrowInputLinear,
    apply_lora,
    export_lora_to_hf,
    export_peft_adapter,
    iter_merged_tensors,
    lora_state_dict,
    merge_lora,
    merged_config,
    save_lora_checkpoint,
)
from litsft.model import Transformer
from litsft.weight_files import load_checkpoint_state_dict, save_checkpoint_files

torch.set_num_threads(1)
TOKENS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
TARGET_SETS = [["q", "v"], "all-linear", ["lm_head"], ["o", "down", "lm_head"]]


def to_lora_names(state_dict: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A plain litsft state dict in the names of a LoRA model (`q_proj.weight` -> `q_proj.base.weight`)."""
    wrapped = {name for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    renamed = {}
    for key, tensor in state_dict.items():
        module, _, suffix = key.rpartition(".")
        renamed[f"{module}.base.{suffix}" if module in wrapped else key] = tensor
    return renamed


def merged_state_dict(
    base_state_dict: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], lora_config: LoRAConfig
) -> dict[str, torch.Tensor]:
    """Base + adapters as a plain state dict, merged tensor by tensor as `litsft merge_lora` does. A base
    without `lm_head.weight` is tied, as litsft checkpoints store it."""
    tied = "lm_head.weight" not in base_state_dict
    tensors = ((n, t) for n, t in base_state_dict.items() if not (tied and n == "lm_head.weight"))
    return dict(iter_merged_tensors(tensors, adapters, lora_config, tie_word_embeddings=tied))


def base_model(tied: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama", tie_word_embeddings=tied))
    with torch.no_grad():  # random norms too, and weights large enough that the logits are far from zero
        for name, param in model.named_parameters():
            param.copy_(
                1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param)
            )
    return model.eval()


def train(model: Transformer, steps: int = 3) -> None:
    """A few AdamW steps on random tokens, as a stand-in for fine-tuning."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    model.train()
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=generator)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@torch.no_grad()
def logits_of(model: torch.nn.Module) -> torch.Tensor:
    return model(TOKENS)


def save_base_checkpoint(model: Transformer, directory: Path) -> Path:
    save_checkpoint_files(model.state_dict().items(), model.config, directory)
    (directory / "tokenizer.json").write_text('{"tiny": true}')
    return directory


def trained_lora_checkpoint(tmp_path: Path, tied: bool, targets) -> tuple[Transformer, Path]:
    base = base_model(tied)
    base_dir = save_base_checkpoint(base, tmp_path / "base")
    model = apply_lora(base, LoRAConfig(targets=targets))
    train(model)
    save_lora_checkpoint(lora_state_dict(model), LoRAConfig(targets=targets), base_dir, tmp_path / "lora")
    return model, tmp_path / "lora"


def load_checkpoint_model(checkpoint_dir: Path) -> Transformer:
    model = Transformer(Config.from_checkpoint(checkpoint_dir))
    model.load_state_dict(load_checkpoint_state_dict(checkpoint_dir))
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_fresh_adapters_leave_logits_unchanged(tied):
    base = base_model(tied)
    expected = logits_of(base)
    model = apply_lora(base, LoRAConfig(targets=["q", "k", "v", "o", "gate", "up", "down", "lm_head"]))
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 7 * 2 + 1
    assert torch.equal(logits_of(model), expected)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("targets", TARGET_SETS)
def test_merged_model_equals_model_with_adapters(targets, tied):
    base = base_model(tied)
    base_state = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    base_logits = logits_of(base)
    lora_config = LoRAConfig(targets=targets)
    model = apply_lora(base, lora_config)
    train(model)
    expected = logits_of(model)
    assert (expected - base_logits).abs().max() > 1e-3  # training moved the outputs

    # From the adapters and the base state dict, as the merge_lora command does it.
    merged = Transformer(merged_config(model.config, lora_config))
    merged.load_state_dict(merged_state_dict(base_state, lora_state_dict(model), lora_config))
    torch.testing.assert_close(logits_of(merged.eval()), expected, atol=1e-5, rtol=0)
    # The input embeddings never change, even when a tied lm_head had an adapter.
    assert torch.equal(merged.embed.weight, base_state["embed.weight"])
    assert merged.config.tie_word_embeddings == (tied and "lm_head" not in lora_config.target_list)


@pytest.mark.parametrize("tied", [False, True])
def test_only_adapters_are_trained(tied):
    base = base_model(tied)
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = apply_lora(base, LoRAConfig(targets="all-linear"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"blocks.{i}.{module}.{adapter}.weight"
        for i in range(2)
        for module in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        for adapter in ("lora_A", "lora_B")
    }
    optimizer_params = {id(p) for p in filter(lambda p: p.requires_grad, model.parameters())}
    assert optimizer_params == {id(p) for n, p in model.named_parameters() if n in trainable}

    train(model)
    after = model.state_dict()
    for name, tensor in to_lora_names(before, model).items():
        assert torch.equal(after[name], tensor), name
    assert all(after[n].abs().sum() > 0 for n in trainable if "lora_B" in n)


@pytest.mark.parametrize("tied", [False, True])
def test_plain_state_dict_loads_into_lora_model(tied):
    base = base_model(tied)
    plain = base.state_dict()
    expected = logits_of(base)
    torch.manual_seed(5)
    model = apply_lora(Transformer(base.config), LoRAConfig(targets=["q", "down", "lm_head"]))
    adapters = {name: tensor.clone() for name, tensor in lora_state_dict(model).items()}
    model.load_state_dict(plain)  # strict: plain names are renamed, adapters kept
    assert torch.equal(logits_of(model.eval()), expected)
    assert all(torch.equal(lora_state_dict(model)[n], t) for n, t in adapters.items())
    # A full LoRA state dict round-trips, adapters included.
    train(model)
    copy_model = apply_lora(Transformer(base.config), LoRAConfig(targets=["q", "down", "lm_head"]))
    copy_model.load_state_dict(model.state_dict())
    assert torch.equal(logits_of(copy_model.eval()), logits_of(model))


@pytest.mark.parametrize("tied", [False, True])
def test_lora_on_meta_device_model(tied):
    base = base_model(tied)
    with torch.device("meta"):
        model = apply_lora(Transformer(base.config), LoRAConfig(targets="all-linear"))
    model.to_empty(device="cpu")
    # What Fabric's materialization does: reset_parameters() on each module that holds parameters.
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    assert all(torch.all(t == 0) for n, t in lora_state_dict(model).items() if "lora_B" in n)
    lora_A = model.blocks[0].attn.q_proj.lora_A.weight.clone()
    for module in model.modules():  # fresh adapters, as a recipe draws them after materializing
        if isinstance(module, LoRALinear):
            module.reset_lora_parameters()
    assert not torch.equal(model.blocks[0].attn.q_proj.lora_A.weight, lora_A)
    model.load_state_dict(to_lora_names(base.state_dict(), model))
    assert torch.equal(logits_of(model.eval()), logits_of(base))


def test_lora_linear_in_bf16():
    base = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    layer = LoRALinear(base, rank=4, alpha=8, dropout=0.0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), base(x))
    torch.nn.init.normal_(layer.lora_B.weight)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    merged = torch.nn.functional.linear(x, (base.weight.float() + layer.delta_weight()).bfloat16(), base.bias)
    torch.testing.assert_close(y, merged, atol=0.1, rtol=0.02)


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
        "base_checkpoint": str((tmp_path / "base").resolve()),
    }
    assert load_file(lora_dir / "adapter.safetensors").keys() == lora_state_dict(model).keys()

    merge_lora(lora_dir)
    merged = load_checkpoint_model(lora_dir / "merged")
    torch.testing.assert_close(logits_of(merged), logits_of(model), atol=1e-5, rtol=0)
    assert merged.config.tie_word_embeddings is False
    assert (lora_dir / "merged" / "tokenizer.json").read_text() == '{"tiny": true}'

    main(["merge_lora", str(lora_dir), "--out_dir", str(tmp_path / "cli")])
    assert torch.equal(logits_of(load_checkpoint_model(tmp_path / "cli")), logits_of(merged))


@pytest.mark.parametrize("kind", ["llama", "llama-tied"])
def test_peft_adapter_reproduces_lora_model(tmp_path, kind):
    hf_model = tiny_hf_model(kind)
    save_tiny_hf(hf_model, tmp_path / "hf", tokenizer=False)
    convert_from_hf(tmp_path / "hf", tmp_path / "base")
    lora_config = LoRAConfig(targets=["q", "k", "v", "o", "gate", "up", "down", "lm_head"], alpha=24)
    model = apply_lora(load_checkpoint_model(tmp_path / "base"), lora_config)
    train(model)
    save_lora_checkpoint(lora_state_dict(model), lora_config, tmp_path / "base", tmp_path / "lora")

    export_peft_adapter(tmp_path / "lora", tmp_path / "peft")
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {k: peft_config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "target_modules")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 24,
        "target_modules": sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
        ),
    }
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "peft").eval()
    # PEFT saves exactly these names (plus, by default, a copy of the base lm_head, which is not needed).
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert saved.keys() == peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False).keys()
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in saved
    assert "base_model.model.lm_head.lora_B.weight" in saved
    with torch.no_grad():
        peft_logits = peft_model(TOKENS).logits
        with peft_model.disable_adapter():
            assert (peft_model(TOKENS).logits - peft_logits).abs().max() > 1e-3
    torch.testing.assert_close(peft_logits, logits_of(model), atol=1e-4, rtol=0)

    export_lora_to_hf(tmp_path / "lora", tmp_path / "merged-hf", format="merged")
    merged_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged_hf(TOKENS).logits, logits_of(model), atol=1e-4, rtol=0)


def test_lora_config_on_the_command_line():
    def recipe(lora: LoRAConfig = LoRAConfig()) -> LoRAConfig:
        return lora

    assert CLI(recipe, args=[]).targets == "all-linear"
    assert CLI(recipe, args=["--lora.targets", "[q, v, lm_head]", "--lora.rank", "4"]) == LoRAConfig(
        rank=4, targets=["q", "v", "lm_head"]
    )
    with pytest.raises(SystemExit):
        CLI(recipe, args=["--lora.targets", "[q, query]"])


def test_unknown_target_is_rejected():
    with pytest.raises(LitsftError) as err:
        LoRAConfig(targets=["q", "query"])
    assert str(err.value) == (
        "lora targets ['query'] are not valid; choose from q, k, v, o, gate, up, down, lm_head or use 'all-linear'"
    )
    with pytest.raises(LitsftError) as err:
        LoRAConfig(targets="all")
    assert str(err.value) == (
        "lora targets='all' is not valid; use 'all-linear' or a list of q, k, v, o, gate, up, down, lm_head"
    )


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
        save_lora_checkpoint(adapters, LoRAConfig(rank=8, targets=["q"]), base_dir, tmp_path / "lora")
    assert str(err.value) == (
        "adapter state dict: tensor 'blocks.0.attn.q_proj.lora_A.weight' has shape (4, 64) but tiny-llama "
        "with rank 8 needs (8, 64); the adapter belongs to a different base checkpoint"
    )
    with pytest.raises(LitsftError) as err:
        save_lora_checkpoint(adapters, LoRAConfig(rank=4, targets=["v"]), base_dir, tmp_path / "lora")
    assert str(err.value) == (
        "adapter state dict: tensor 'blocks.0.attn.q_proj.lora_A.weight' is not an adapter of tiny-llama "
        "with targets ['v']; the adapter belongs to a different model or LoRA config"
    )
    assert not (tmp_path / "lora").exists()


def test_narrow_input_linear_has_the_gradients_of_a_linear_layer():
    """lora_B's backward computes transposed products; gradients are those of F.linear."""
    h = torch.randn(2, 7, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(NarrowInputLinear.apply, (h, weight))
    h32, w32 = h.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    grad = torch.randn(2, 7, 11)
    NarrowInputLinear.apply(h32, w32).backward(grad)
    expected = torch.autograd.grad(F.linear(h32, w32), (h32, w32), grad)
    torch.testing.assert_close(h32.grad, expected[0])
    torch.testing.assert_close(w32.grad, expected[1])


def test_adapter_dropout_drops_p_of_the_inputs_and_keeps_the_mean():
    dropout = AdapterDropout(0.05).train()
    x = torch.ones(1000, 1000, requires_grad=True)
    torch.manual_seed(3)
    y = dropout(x)
    kept = y != 0
    # 1e6 draws: the dropped share's standard deviation is 2.2e-4.
    assert abs((~kept).float().mean().item() - 0.05) < 1.5e-3
    assert torch.allclose(y[kept], torch.tensor(1 / 0.95))  # scaled so that E[y] = x
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient flows through the kept inputs only, scaled alike
    torch.manual_seed(3)
    assert torch.equal(dropout(x), y)  # the default generator decides: seeding reproduces the mask
    assert not torch.equal(dropout(x), y)
    assert torch.equal(dropout.eval()(x), x)
