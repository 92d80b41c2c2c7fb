import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from jsonargparse import CLI

from litsft.checkpoint.lora_folder import save_lora_folder
from litsft.checkpoint.model_folder import load_model_state_dict, save_model_folder
from litsft.errors import LitsftError
from litsft.model.accounting.sizes import num_parameters
from litsft.model.config import Config
from litsft.model.lora.layers import (
    LoRAConfig,
    LoRALinear,
    NarrowInputLinear,
    apply_lora,
    base_weight_name,
    check_expert_targets,
    iter_merged_tensors,
    lora_state_dict,
    merged_config,
)
from litsft.model.network.transformer import Transformer

torch.set_num_threads(1)
TOKENS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
TARGET_SETS = [["q", "v"], "all-linear", ["lm_head"], ["o", "down", "lm_head"]]


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
    save_model_folder(model.state_dict().items(), model.config, directory)
    (directory / "tokenizer.json").write_text('{"tiny": true}')
    return directory


def trained_lora_checkpoint(tmp_path: Path, tied: bool, targets) -> tuple[Transformer, Path]:
    base = base_model(tied)
    base_dir = save_base_checkpoint(base, tmp_path / "base")
    model = apply_lora(base, LoRAConfig(targets=targets))
    train(model)
    save_lora_folder(lora_state_dict(model), LoRAConfig(targets=targets), base_dir, tmp_path / "lora")
    return model, tmp_path / "lora"


def load_checkpoint_model(checkpoint_dir: Path) -> Transformer:
    model = Transformer(Config.from_checkpoint(checkpoint_dir))
    model.load_state_dict(load_model_state_dict(checkpoint_dir))
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

    # From the adapters and the base state dict, one tensor at a time, as the merge_lora command does it.
    merged_tensors = dict(iter_merged_tensors(base_state.items(), lora_state_dict(model), lora_config))
    merged = Transformer(merged_config(model.config, lora_config))
    merged.load_state_dict(merged_tensors)
    torch.testing.assert_close(logits_of(merged.eval()), expected, atol=1e-5, rtol=0)
    # The input embeddings never change, even when a tied lm_head had an adapter.
    assert torch.equal(merged_tensors["embed.weight"], base_state["embed.weight"])
    assert merged.config.tie_word_embeddings == (tied and "lm_head" not in lora_config.target_list)


@pytest.mark.parametrize("variant", ["rslora", "dora"])
def test_variants_start_as_the_base_train_and_merge(variant):
    """rsLoRA and DoRA, like LoRA: a fresh adapter changes nothing, the merged model equals the adapted one.
    DoRA trains a magnitude per output row, which starts as the row norms of the base weight."""
    base = base_model(tied=True)
    base_state = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    expected = logits_of(base)
    lora_config = LoRAConfig(targets=["q", "down", "lm_head"], variant=variant, rank=4, alpha=8)
    model = apply_lora(base, lora_config)
    if variant == "dora":  # m / ||W|| is 1 up to rounding
        torch.testing.assert_close(logits_of(model), expected, atol=1e-6, rtol=0)
    else:
        assert torch.equal(logits_of(model), expected)
    magnitudes = {n: t.clone() for n, t in lora_state_dict(model).items() if "magnitude" in n}
    assert magnitudes.keys() == (
        {
            f"blocks.{i}.{m}.lora_magnitude_vector.weight"
            for i in range(2)
            for m in ("attn.q_proj", "mlp.down_proj")
        }
        | {"lm_head.lora_magnitude_vector.weight"}
        if variant == "dora"
        else set()
    )
    for name, magnitude in magnitudes.items():
        weight = base_state[name.replace(".lora_magnitude_vector", "").replace("lm_head", "embed")]
        torch.testing.assert_close(magnitude, weight.norm(dim=1))
    train(model)
    assert all(not torch.equal(lora_state_dict(model)[n], t) for n, t in magnitudes.items())
    merged = Transformer(merged_config(model.config, lora_config))
    merged.load_state_dict(
        dict(iter_merged_tensors(base_state.items(), lora_state_dict(model), lora_config, True))
    )
    torch.testing.assert_close(logits_of(merged.eval()), logits_of(model), atol=1e-5, rtol=0)


def test_rslora_scales_by_the_square_root_of_the_rank():
    assert LoRAConfig(rank=16, alpha=8).scaling == 0.5
    assert LoRAConfig(rank=16, alpha=8, variant="rslora").scaling == 2.0
    layer = (
        apply_lora(base_model(False), LoRAConfig(rank=16, alpha=8, variant="rslora")).blocks[0].attn.q_proj
    )
    assert layer.scaling == 2.0
    with pytest.raises(
        LitsftError,
        match="--lora.variant='qlora' is not valid; choose one of lora, dora, loraplus, pissa, rslora",
    ):
        LoRAConfig(variant="qlora")


def test_dora_gradient_treats_the_row_norm_as_a_constant():
    """PEFT's DoRA (section 4.3 of the paper): the magnitude's gradient is (W x + s B A x) / ||W + s B A|| times
    the output gradient, with no term from the norm; dropout recomputes W x on the dropped-out input."""
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 8)
    layer = LoRALinear(base, rank=2, alpha=4, dropout=0.0, variant="dora")
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(5, 16)
    layer(x).sum().backward()
    combined = base.weight + layer.delta_weight()
    norm = combined.norm(dim=1)
    torch.testing.assert_close(layer.lora_magnitude_vector.weight.grad, (x @ combined.t() / norm).sum(0))


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
    frozen = {base_weight_name(name): name for name in after if base_weight_name(name) is not None}
    assert frozen.keys() == before.keys()
    for stored, name in frozen.items():
        assert torch.equal(after[name], before[stored]), name
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
    model.load_state_dict(base.state_dict())  # plain names: LoRALinear renames them
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
        "lora targets ['query'] are not valid; choose from q, k, v, o, gate, up, down, experts, lm_head or use 'all-linear'"
    )
    with pytest.raises(LitsftError) as err:
        LoRAConfig(targets="all")
    assert str(err.value) == (
        "lora targets='all' is not valid; use 'all-linear' or a list of q, k, v, o, gate, up, down, experts, lm_head"
    )


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


# ---- a lean base under mixed precision ------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_frozen_base_in_bf16_trains_like_the_fp32_base(tied):
    """Under bf16-mixed the engine stores the frozen base in bf16 (no fp32 copy, no per-step cast) and keeps
    the adapters fp32: loss and adapter gradients equal those of the fp32 base under the same autocast within
    bf16 rounding (the matmuls saw bf16 weights before too; only norms and embedding rows are rounded now)."""
    from litsft.training.engine import store_frozen_in_compute_dtype

    reference = apply_lora(base_model(tied), LoRAConfig(rank=4, alpha=8, dropout=0.0))
    with torch.no_grad():  # adapters away from zero, so that B's gradients depend on A and the base
        for name, param in reference.named_parameters():
            if "lora_" in name:
                param.normal_(std=0.1)
    lean = copy.deepcopy(reference)
    store_frozen_in_compute_dtype(lean, torch.bfloat16)
    assert {p.dtype for p in lean.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in lean.parameters() if p.requires_grad} == {torch.float32}
    frozen_bytes = sum(p.numel() * p.element_size() for p in lean.parameters() if not p.requires_grad)
    assert frozen_bytes * 2 == sum(p.numel() * 4 for p in reference.parameters() if not p.requires_grad)
    # The fp32 base holding bf16-rounded values: rounding the base is all that the lean storage changes.
    rounded = copy.deepcopy(reference)
    with torch.no_grad():
        for param in rounded.parameters():
            if not param.requires_grad:
                param.copy_(param.to(torch.bfloat16).float())
    labels = TOKENS.roll(-1, dims=1)
    results = []
    for model in (reference, lean, rounded):
        model.train()
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(TOKENS, labels=labels) / labels.numel()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (loss, grads), (lean_loss, lean_grads), (rounded_loss, rounded_grads) = results
    assert torch.equal(lean_loss, rounded_loss)
    assert all(torch.equal(lean_grads[name], rounded_grads[name]) for name in grads)
    torch.testing.assert_close(lean_loss, loss, atol=0, rtol=1e-3)
    for name, grad in grads.items():
        assert lean_grads[name].dtype == torch.float32
        # bf16 rounding of norms and embeddings: a few percent of the largest gradient at most.
        assert (lean_grads[name] - grad).abs().max() <= 0.05 * grad.abs().max(), name


def test_engine_stores_the_lora_base_in_bf16_under_bf16_mixed(tmp_path):
    """setup_model as finetune_lora runs it: bf16 base, fp32 adapters, and the memory line says so."""
    from lightning.fabric import Fabric

    from litsft.training.args import RunConfig
    from litsft.training.engine import Recipe, setup_model

    config = Config.from_name("tiny-llama")
    messages = []
    for precision in ("bf16-mixed", "32-true"):
        fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
        fabric.print = messages.append
        recipe = Recipe(
            name="finetune_lora",
            build_model=lambda c: apply_lora(Transformer(c), LoRAConfig()),
            initialize=lambda model: model.init_weights(),
            save_final=lambda model, path: None,
            trainable="lora",
        )
        run = RunConfig(config=config, tokenizer_dir=None, data=None, out_dir=tmp_path, precision=precision)
        model = setup_model(fabric, recipe, run).module
        frozen = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {frozen}
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
        assert model.lm_head.weight is model.embed.weight or not config.tie_word_embeddings
    frozen = num_parameters(config)
    assert f"frozen weights {frozen * 2 / 2**20:,.1f} MiB (bfloat16)" in messages[1]
    assert f"frozen weights {frozen * 4 / 2**20:,.1f} MiB (float32)" in messages[3]
    assert (
        messages[0] == messages[2] == "Attention: segmented, per-document SDPA, one document at a time (CPU)"
    )


def test_lora_on_a_mixture_of_experts_adapts_the_experts_only_when_named():
    """all-linear adapts q, k, v and o of an MoE model and leaves its router and experts frozen; 'experts'
    (or gate, up and down) adds per-expert adapters; what cannot be trained on the experts is refused in one
    line: gate without up, another variant, dropout, QLoRA (torchao's NF4 is 2D only), 'experts' on a dense model."""
    config = Config.from_name(
        "tiny-llama", hf_architecture="MixtralForCausalLM", num_experts=4, experts_per_token=2
    )
    model = apply_lora(Transformer(config), LoRAConfig(rank=2))
    trained = {name.split(".")[3] for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for targets in (["q", "experts"], ["gate", "up", "down"]):
        model = apply_lora(Transformer(config), LoRAConfig(rank=2, dropout=0.0, targets=targets))
        trained = {name.split(".", 3)[3] for name, p in model.named_parameters() if p.requires_grad}
        assert {"experts.gate_up_lora.lora_A.weight", "experts.down_lora.lora_B.weight"} <= trained
        assert not any("router" in name or name.endswith("_proj") for name in trained)
    refusals = {
        "fuse gate and up": LoRAConfig(rank=2, dropout=0.0, targets=["q", "up"]),
        "variant dora does not adapt": LoRAConfig(rank=2, dropout=0.0, targets=["experts"], variant="dora"),
        "have no dropout": LoRAConfig(rank=2, targets=["experts"]),
    }
    for message, lora in refusals.items():
        with pytest.raises(LitsftError, match=message):
            apply_lora(Transformer(config), lora)
    with pytest.raises(LitsftError, match="NF4 stores 2D weights only"):
        check_expert_targets(LoRAConfig(rank=2, dropout=0.0, targets=["experts"]), config, "nf4")
    check_expert_targets(LoRAConfig(rank=2, dropout=0.0, targets=["q"]), config, "nf4")
    with pytest.raises(LitsftError, match="is not a mixture of experts"):
        apply_lora(Transformer(Config.from_name("tiny-llama")), LoRAConfig(rank=2, targets=["experts"]))
