"""QLoRA's NF4 base (litsft/model/precision/quantization.py): what the model computes with it, how a shard's NF4 data relate
to the unsharded quantization, and merging adapters trained on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import write_tiny_checkpoint
from test_model_lora_layers import train

from litsft.checkpoint.lora_folder import read_lora_folder, save_lora_folder
from litsft.checkpoint.model_folder import load_model_state_dict, load_model_weights
from litsft.errors import LitsftError
from litsft.huggingface.convert import merge_lora
from litsft.model.config import Config
from litsft.model.lora.layers import LoRAConfig, LoRALinear, apply_lora, base_weight_name, lora_state_dict
from litsft.model.network.transformer import Transformer
from litsft.model.precision.quantization import (
    NF4_BYTES_PER_WEIGHT,
    NF4Linear,
    check_nf4_shardable,
    is_nf4,
    iter_nf4_base,
    load_nf4_weight,
    quantize_base,
    stored_bytes,
    to_nf4,
)

torch.set_num_threads(1)
# Every projection of this model splits into 2 shards of whole NF4 scale blocks (64 x 256 values).
NF4_SHAPES = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("nf4") / "base", seed=1, **NF4_SHAPES)


def qlora_model(base_dir: Path, lora: LoRAConfig) -> Transformer:
    """As finetune_lora --quantize nf4 builds it: on the meta device, materialized, then loaded."""
    config = Config.from_checkpoint(base_dir)
    with torch.device("meta"):
        model = quantize_base(apply_lora(Transformer(config), lora), "nf4")
    model.to_empty(device="cpu")
    load_model_weights(model, base_dir, stored_name=base_weight_name)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_lora_parameters()  # fresh adapters; DoRA's magnitudes from the loaded NF4 rows
    return model


def with_random_adapters(model: Transformer) -> Transformer:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator) + ("magnitude" in name))
    return model.eval()


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_nf4_logits_equal_dequantize_then_matmul_and_stay_within_the_nf4_error(base_dir, variant):
    lora = LoRAConfig(rank=4, alpha=8, variant=variant)
    model = with_random_adapters(qlora_model(base_dir, lora))
    quantized = {name for name, p in model.named_parameters() if is_nf4(p)}
    assert len(quantized) == 2 * 7 and all(".base.weight" in name for name in quantized)
    # What torchao allocates per weight (fp32 scale factors): what the planner and the memory line count.
    nf4_bytes = sum(stored_bytes(p) for p in model.parameters() if is_nf4(p))
    allocated = sum(
        getattr(p, inner).numel() * getattr(p, inner).element_size()
        for p in model.parameters()
        if is_nf4(p)
        for inner in ("quantized_data", "quantized_scalers", "quantization_factor")
    )
    assert (
        nf4_bytes
        == allocated
        == sum(p.numel() for p in model.parameters() if is_nf4(p)) * NF4_BYTES_PER_WEIGHT
    )

    # The reference: a plain LoRA model whose base holds the dequantized NF4 weights, the same adapters.
    base = load_model_state_dict(base_dir)
    adapters = lora_state_dict(model)
    reference = apply_lora(Transformer(model.config), lora)
    reference.load_state_dict({**dict(iter_nf4_base(base.items(), adapters)), **adapters})
    with torch.no_grad():
        logits = model(TOKENS)
        assert torch.equal(logits, reference.eval()(TOKENS))

        # Against the unquantized base: NF4 moves each weight by at most half the widest gap of its 16 levels
        # (0.152 of its block's absmax) plus the int8 rounding of that absmax; the logits move about as much
        # as they do under Gaussian noise of the same size on each quantized weight (measured: 0.17 vs 0.16).
        generator = torch.Generator().manual_seed(0)
        noisy = dict(base)
        for name in quantized:
            weight = base[base_weight_name(name)]
            error = to_nf4(weight).get_original_weight() - weight
            absmax = weight.abs().view(-1, 64).amax(dim=1, keepdim=True)
            assert (error.abs().view(-1, 64) <= 0.16 * absmax).all(), name
            noise = torch.randn(weight.shape, generator=generator) * error.pow(2).mean().sqrt()
            noisy[base_weight_name(name)] = weight + noise
        relative = {}
        for kind, state in (("nf4", None), ("exact", base), ("noise", noisy)):
            if state is not None:
                other = apply_lora(Transformer(model.config), lora)
                other.load_state_dict({**state, **adapters})
                relative[kind] = other.eval()(TOKENS)
        exact = relative["exact"]
        nf4_error = (logits - exact).norm() / exact.norm()
        noise_error = (relative["noise"] - exact).norm() / exact.norm()
        assert 0.01 < nf4_error < 1.5 * noise_error, (nf4_error, noise_error)


@pytest.fixture
def two_rank_group():
    """A fake 2-process group, this process being rank 1: enough for meshes and DTensor placements."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape", [(2,), (1, 2)], ids=["FULL_SHARD", "HYBRID_SHARD"])
def test_a_shard_holds_the_rows_of_the_unsharded_quantization(two_rank_group, mesh_shape):
    """Rank 1's NF4 shard is rows 64:128 of the whole weight's quantization; quantizing those rows alone
    would differ (the scales' mean is the whole weight's), so a shard is never quantized on its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    module = NF4Linear(256, 128, bias=False)
    module.weight = torch.nn.Parameter(
        DTensor.from_local(torch.empty(64, 256), mesh, placements, run_check=False), requires_grad=False
    )
    full = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    load_nf4_weight(module, full)
    shard = module.weight.to_local()
    assert is_nf4(shard) and shard.shape == (64, 256) and module.weight.shape == (128, 256)
    whole = to_nf4(full)
    halves = {"quantized_data": 64 * 256 // 2, "quantized_scalers": 64 * 256 // 64, "quantization_factor": 1}
    for attribute, half in halves.items():
        assert torch.equal(getattr(shard, attribute), getattr(whole, attribute)[half:]), attribute
    assert torch.equal(shard.scaler_mean, whole.scaler_mean)
    assert torch.equal(shard.get_original_weight(), whole.get_original_weight()[64:])
    assert not torch.equal(to_nf4(full[64:]).get_original_weight(), whole.get_original_weight()[64:])


def test_a_shard_group_that_splits_a_scale_block_is_refused():
    check_nf4_shardable(Config.from_name("tiny-llama", **NF4_SHAPES), 2)
    check_nf4_shardable(Config.from_name("tiny-llama", **NF4_SHAPES), 4, ["q", "o", "gate", "up", "down"])
    with pytest.raises(LitsftError) as error:
        check_nf4_shardable(Config.from_name("tiny-llama", **NF4_SHAPES), 4)
    assert str(error.value) == (
        "--quantize nf4: k_proj's weight (128 x 256) cannot be split into 4 shards of whole NF4 scale blocks "
        "(16384 values each); use fewer devices per shard group, or --fsdp.sharding_strategy NO_SHARD "
        "(or HYBRID_SHARD over several nodes)"
    )
    with pytest.raises(LitsftError) as error:
        check_nf4_shardable(Config.from_name("tiny-llama"), 1)
    assert str(error.value) == (
        "--quantize nf4: q_proj's weight (64 x 64) is not a whole number of NF4 scale blocks (16384 values "
        "each); train this model without --quantize"
    )


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_adapters_trained_on_nf4_merge_into_the_dequantized_base(base_dir, tmp_path, variant):
    lora = LoRAConfig(rank=4, alpha=8, variant=variant, targets=["q", "v", "down"])
    model = qlora_model(base_dir, lora)
    train(model)
    save_lora_folder(lora_state_dict(model), lora, base_dir, tmp_path / "lora", base_quantization="nf4")
    assert read_lora_folder(tmp_path / "lora").base_quantization == "nf4"
    with torch.no_grad():
        expected = model(TOKENS)
    for dtype, tolerance in (("float32", 1e-5), ("bfloat16", 0.1)):
        merge_lora(tmp_path / "lora", tmp_path / dtype, dtype=dtype)
        merged_state = load_model_state_dict(tmp_path / dtype)
        assert {t.dtype for t in merged_state.values()} == {getattr(torch, dtype)}
        merged = Transformer(Config.from_checkpoint(tmp_path / dtype))
        merged.load_state_dict({k: v.float() for k, v in merged_state.items()})
        with torch.no_grad():
            torch.testing.assert_close(merged.eval()(TOKENS), expected, atol=tolerance, rtol=0)


def test_the_peft_export_of_qlora_adapters_says_it_differs_by_nf4_rounding_and_the_merged_one_is_exact(
    base_dir, tmp_path, capsys
):
    """PEFT names the unquantized base: the adapters on it are not the trained model (they were trained on the
    NF4 weights), the merged export is. The export says so, and the two differences are measured here."""
    from litsft.huggingface.convert import convert_to_hf

    lora = LoRAConfig(rank=4, alpha=8, targets=["q", "v", "down"])
    model = qlora_model(base_dir, lora)
    train(model)
    save_lora_folder(lora_state_dict(model), lora, base_dir, tmp_path / "lora", base_quantization="nf4")
    convert_to_hf(tmp_path / "lora", tmp_path / "peft", lora_format="peft")
    out = " ".join(capsys.readouterr().out.split())
    assert f"note: {tmp_path / 'peft'} names the unquantized base" in out
    assert "differ from the trained model's by NF4's rounding" in out
    assert f"litsft convert_to_hf {tmp_path / 'lora'} --lora_format merged" in out
    # What the PEFT adapter gives: the same adapters on the unquantized base.
    on_unquantized = apply_lora(Transformer(Config.from_checkpoint(base_dir)), lora)
    load_model_weights(on_unquantized, base_dir, stored_name=base_weight_name)
    on_unquantized.load_state_dict(lora_state_dict(model), strict=False)
    merge_lora(tmp_path / "lora", tmp_path / "merged", dtype="float32")
    merged = Transformer(Config.from_checkpoint(tmp_path / "merged"))
    merged.load_state_dict(load_model_state_dict(tmp_path / "merged"))
    with torch.no_grad():
        trained = model.eval()(TOKENS)
        assert (on_unquantized.eval()(TOKENS) - trained).abs().max() > 1e-2  # NF4's rounding shows
        torch.testing.assert_close(merged.eval()(TOKENS), trained, atol=1e-5, rtol=0)
    convert_to_hf(tmp_path / "lora", tmp_path / "merged-hf")  # merged: no such note
    assert "note:" not in capsys.readouterr().out
