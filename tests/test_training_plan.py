import dataclasses
import inspect
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from launch import TINY_MOE

from litsft.__main__ import main
from litsft.errors import LitsftError
from litsft.model.accounting.flops import lora_parameters
from litsft.model.accounting.sizes import model_sizes, num_parameters
from litsft.model.config import Config
from litsft.model.lora.layers import LoRAConfig, apply_lora
from litsft.model.lora.variants import VARIANT_NAMES
from litsft.model.network.transformer import Transformer
from litsft.model.precision.quantization import (
    NF4_BYTES_PER_WEIGHT,
    NF4Linear,
    load_nf4_weight,
    to_nf4,
    torchao_nf4,
)
from litsft.training.args import FSDPConfig, TrainConfig
from litsft.training.plan import (
    NF4_DEQUANTIZE_BYTES,
    NF4_QUANTIZE_CHUNK_VALUES,
    PREFETCHED_BLOCKS,
    RUNTIME_BYTES,
    adapter_buffer_bytes,
    adapter_parameters,
    block_activation_bytes_per_token,
    block_parameters,
    context_attention_bytes,
    estimate_memory,
    expert_dispatch_bytes,
    fits,
    parse_memory_size,
    plan,
    root_parameters,
)

LLAMA_2_7B = 6_738_415_616
LLAMA_2_70B = 68_976_648_192
GB = 10**9


LORA_QKVO = LoRAConfig(targets=["q", "k", "v", "o"])


def test_plan_takes_the_recipes_options():
    """Every option of finetune_full and finetune_lora is an option of plan, of the same type, so a recipe's
    YAML is a plan's YAML."""
    from litsft.recipes import finetune_full, finetune_lora

    planned = inspect.signature(plan).parameters
    for recipe in (finetune_full, finetune_lora):
        for name, parameter in inspect.signature(recipe.setup).parameters.items():
            assert name in planned, (recipe.__name__, name)
            if name in ("devices", "num_nodes", "fsdp", "parallel", "precision", "lora"):
                assert planned[name].annotation == parameter.annotation or (
                    name == "lora" and planned[name].annotation == "LoRAConfig | None"
                ), name


def test_lora_parameters_match_the_model():
    config = Config.from_name("tiny-llama")
    for targets in (["q", "k", "v", "o"], "all-linear", ["down", "lm_head"]):
        lora = LoRAConfig(rank=4, targets=targets)
        model = apply_lora(Transformer(config), lora)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert lora_parameters(config, lora.target_list, lora.rank) == trained, targets


def test_parameter_split_adds_up():
    config = Config.from_name("Llama-2-7b-hf")
    assert root_parameters(config) == 2 * 32000 * 4096 + 4096
    assert block_parameters(config) * 32 + root_parameters(config) == LLAMA_2_7B


def test_full_shard_bf16_mixed_divides_fp32_states_by_eight():
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8)
    assert estimate.parameters == LLAMA_2_7B * 4 // 8 == 3_369_207_808
    assert estimate.gradients == LLAMA_2_7B * 4 // 8
    assert estimate.optimizer_states == 2 * LLAMA_2_7B * 4 // 8


def test_bf16_true_keeps_weights_and_gradients_in_two_bytes_and_compensates_updates():
    # AdamW's fp32 moments (8 bytes) and the bf16 Kahan compensation (2 bytes) per parameter.
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, precision="bf16-true")
    assert (estimate.parameters, estimate.gradients, estimate.optimizer_states) == (
        LLAMA_2_7B * 2 // 8,
        LLAMA_2_7B * 2 // 8,
        LLAMA_2_7B * 10 // 8,
    )


def test_shard_group_per_strategy():
    config = Config.from_name("Llama-2-7b-hf")
    per_strategy = {
        strategy: estimate_memory(config, devices=8, num_nodes=2, sharding_strategy=strategy).parameters
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
    }
    assert per_strategy == {
        "FULL_SHARD": LLAMA_2_7B * 4 // 16,
        "SHARD_GRAD_OP": LLAMA_2_7B * 4 // 16,
        "HYBRID_SHARD": LLAMA_2_7B * 4 // 8,  # sharded within a node only
        "NO_SHARD": LLAMA_2_7B * 4,
    }


def test_no_shard_7b_full_finetune_does_not_fit_80gb():
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, sharding_strategy="NO_SHARD")
    # 4 (fp32 weights) + 4 (fp32 grads) + 8 (AdamW) = 16 bytes per parameter: 108 GB before activations.
    assert (
        estimate.parameters + estimate.gradients + estimate.optimizer_states
        == 16 * LLAMA_2_7B
        == 107_814_649_856
    )
    assert not fits(estimate, 80 * GB)


def test_7b_full_shard_on_8_devices_fits_80gb():
    """The numbers `litsft plan Llama-2-7b-hf --devices 8 --device_memory 80GB` prints (and
    tutorials/memory_planning.md's table shows), pinned. The states are exact: fp32 weights, fp32 gradients
    and AdamW's two fp32 moments, 16 bytes per parameter over 8 ranks. Activations (micro batch 1 x 2048
    tokens, no activation checkpointing) and transients (all-gathered bf16 blocks, a logits chunk, reduction
    buffers) are the planner's model, calibrated within 15% of measured peaks on the CPU
    (benchmarks/bench_plan_vs_measured.py): pinned to 0.5%, so a change to that model is a deliberate edit
    here and in the tutorial, not a drift."""
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8)
    assert (estimate.parameters, estimate.gradients, estimate.optimizer_states) == (
        LLAMA_2_7B * 4 // 8,
        LLAMA_2_7B * 4 // 8,
        LLAMA_2_7B * 8 // 8,
    )
    gib = {kind: round(count / 2**30, 2) for kind, count in estimate.breakdown().items()}
    assert gib["parameters"] == 3.14 and gib["optimizer states"] == 6.28
    assert estimate.activations / 2**30 == pytest.approx(11.43, rel=0.005)
    assert estimate.transients / 2**30 == pytest.approx(3.23, rel=0.005)
    # Not accumulating: 3.14 + 6.28 + max(3.14, 11.43 + 3.23).
    assert (
        estimate.total
        == estimate.parameters + estimate.optimizer_states + estimate.activations + estimate.transients
    )
    assert estimate.total / 2**30 == pytest.approx(24.07, rel=0.005)
    assert fits(estimate, 80 * GB)
    assert not fits(estimate, 24 * GB)  # 90% of 24 GB is 20.1 GiB


def test_70b_on_8x80gb():
    config = Config.from_name("Llama-2-70b-hf")
    full = estimate_memory(config, devices=8, activation_checkpointing=True)
    # 16 bytes per parameter over 8 devices is 2 bytes per parameter: 138 GB of states alone.
    assert full.parameters + full.gradients + full.optimizer_states == 2 * LLAMA_2_70B
    assert not fits(full, 80 * GB)
    # Four nodes of eight: 0.5 bytes per parameter of states, 34.5 GB, plus activations and transients.
    four_nodes = estimate_memory(config, devices=8, num_nodes=4, activation_checkpointing=True)
    assert four_nodes.parameters + four_nodes.gradients + four_nodes.optimizer_states == LLAMA_2_70B // 2
    assert fits(four_nodes, 80 * GB)
    # LoRA in bf16-true: the frozen base is 2 bytes per parameter, 17.2 GB per device. Rank-8 adapters on
    # all-linear (LoRAConfig's default), per block: q and o 8192 + 8192, k and v 8192 + 1024, gate and up
    # 8192 + 28672, down 28672 + 8192.
    lora = estimate_memory(
        config, devices=8, precision="bf16-true", lora=LoRAConfig(), activation_checkpointing=True
    )
    adapters = 80 * 8 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 28672))
    assert adapters == 103_546_880
    assert lora.parameters == (LLAMA_2_70B + adapters) * 2 // 8
    assert fits(lora, 80 * GB)


def test_lora_trains_only_the_adapters():
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, lora=LoRAConfig(rank=8))
    # Rank 8 on all-linear: q, k, v, o are 4096 x 4096, gate and up 4096 -> 11008, down 11008 -> 4096.
    adapters = 32 * 8 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert adapters == 19_988_480
    qkvo = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, lora=LORA_QKVO)
    assert qkvo.gradients == 32 * 8 * 4 * (4096 + 4096) * 4 // 8  # 8,388,608 adapters on q, k, v, o
    # bf16-mixed: the frozen base in bf16 (2 bytes), the adapters in fp32 (4 bytes).
    assert estimate.parameters == (LLAMA_2_7B * 2 + adapters * 4) // 8
    assert estimate.gradients == adapters * 4 // 8
    assert estimate.optimizer_states == adapters * 8 // 8


def test_llama_block_activations_by_hand():
    """What autograd saves in a Llama-2-7b block, by hand (bf16, per token), against the count recorded from
    the block's forward pass."""
    config = Config.from_name("Llama-2-7b-hf")
    # Each RMSNorm: its fp32 input and 1/rms (both for the input's gradient), the normalized input cast to
    # bf16 (for its weight's gradient) and its output (for the projections' weight gradients).
    norms = 2 * (4 * 4096 + 4 + 2 * 4096 + 2 * 4096)
    # The fused kernel: q, k, v and its output (which o_proj reads as it is), a fp32 logsumexp per head.
    attention = 4 * 4096 * 2 + 4 * 32
    mlp = 4 * 11008 * 2  # gate, silu, up, product
    assert block_activation_bytes_per_token(config, 2) == norms + attention + mlp == 186_504
    # Everything frozen in the blocks (an adapter on lm_head only): no weight gradient needs the norms'
    # outputs or the product down_proj reads; what the input's gradient needs stays.
    frozen = 2 * (4 * 4096 + 4) + attention + 3 * 11008 * 2
    assert block_activation_bytes_per_token(config, 2, LoRAConfig(targets=["lm_head"])) == frozen == 131_720


def test_post_norms_add_their_fp32_inputs_and_a_block_without_pre_norms_keeps_no_upcast():
    """Gemma's sandwich adds two norms after attention and the MLP, each keeping its fp32 input, 1/rms and the
    normalized input cast for its weight's gradient (its output goes into the residual add, which keeps
    nothing); OLMo 2 moves the norms there, so the q/k/v and MLP inputs are the residual stream's own bf16
    tensors, kept without an fp32 upcast, a cast or a norm output beside them."""
    llama = Config.from_name("tiny-llama", hidden_size=64, num_heads=4, num_kv_heads=2)
    C = llama.hidden_size
    gemma = dataclasses.replace(llama, post_attention_norm=True, post_mlp_norm=True)
    olmo = dataclasses.replace(gemma, pre_norms=False)
    plain = block_activation_bytes_per_token(llama, 2)
    post_norm = 4 * C + 4 + 2 * C
    assert block_activation_bytes_per_token(gemma, 2) == plain + 2 * post_norm
    pre_norm = 4 * C + 4 + 2 * C + 2 * C
    assert block_activation_bytes_per_token(olmo, 2) == plain + 2 * post_norm - 2 * pre_norm + 2 * 2 * C


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    config = Config.from_name("Llama-2-7b-hf")
    head = 2048 * (4096 * 6 + 2 * 128 * 2)  # final norm, RoPE cos and sin
    plain = estimate_memory(config, devices=8)
    assert plain.activations == 32 * 186_504 * 2048 + head
    checkpointed = estimate_memory(config, devices=8, activation_checkpointing=True)
    assert checkpointed.activations == 32 * 2048 * 4096 * 2 + 186_504 * 2048 + head == 970_211_328


def test_transients():
    config = Config.from_name("Llama-2-7b-hf")
    logits = 2048 * 32000 * (2 + 12)
    block = block_parameters(config)
    full_shard = estimate_memory(config, devices=8)
    # Two blocks and the root all-gathered in bf16, one block's gradients in bf16 and fp32, a logits chunk.
    assert full_shard.transients == (2 * block + root_parameters(config)) * 2 + block * (2 + 4) + logits
    shard_grad_op = estimate_memory(config, devices=8, sharding_strategy="SHARD_GRAD_OP")
    assert shard_grad_op.transients - full_shard.transients == 30 * block * 2
    # One process: nothing is all-gathered; 32-true needs no compute copy at all.
    single = estimate_memory(config, precision="32-true")
    assert single.transients == 2048 * 32000 * (4 + 12)
    # One process in bf16-mixed: autocast keeps a bf16 copy of every weight for the backward pass.
    assert estimate_memory(config).transients == LLAMA_2_7B * 2 + logits


def test_total_counts_gradients_against_activations():
    # 7B FULL_SHARD on 8 GPUs, by hand (tutorials/memory_planning.md): weights and AdamW states always,
    # then the larger of gradients (3.14 GiB) and activations + transients (11.43 + 3.23 GiB).
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8)
    assert estimate.total == (
        estimate.parameters + estimate.optimizer_states + estimate.activations + estimate.transients
    )
    assert round(estimate.total / 2**30, 2) == 24.07
    # NO_SHARD: the replicated fp32 gradients (25.10 GiB) outweigh the activations.
    no_shard = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, sharding_strategy="NO_SHARD")
    assert no_shard.total == (4 + 8 + 4) * LLAMA_2_7B
    # Gradient accumulation keeps gradients alive through the next forward pass: everything adds up.
    accumulating = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, accumulation_steps=2)
    assert accumulating.total == estimate.total + estimate.gradients


def test_parse_memory_size():
    assert parse_memory_size("80GB") == 80 * 10**9
    assert parse_memory_size("80GiB") == 80 * 2**30
    assert parse_memory_size("24 gb") == 24 * 10**9
    assert parse_memory_size("1.5TB") == 1_500_000_000_000
    with pytest.raises(LitsftError) as error:
        parse_memory_size("80")
    assert str(error.value) == "device_memory '80' is not a memory size; write it like 80GB or 80GiB"


def test_plan_prints_breakdown_and_verdict(capsys):
    plan("Llama-2-7b-hf", devices=8, fsdp=FSDPConfig(sharding_strategy="NO_SHARD"), device_memory="80GB")
    out = capsys.readouterr().out
    assert "Llama-2-7b-hf (6.74B parameters), full fine-tuning, bf16-mixed" in out
    assert "optimizer states      50.21" in out.splitlines()
    assert out.strip().endswith("does not fit: 100.41 GiB needed, 67.06 GiB usable of 80GB (90%)")


def test_plan_prints_the_runtime_beside_the_total_and_what_a_process_peaks_at(tmp_path, capsys):
    """A small mixture of experts plans less than the runtime every process holds besides it (Python, torch,
    Lightning): the lines under the total give it, and what a CPU process peaks at with it."""
    Config.from_name("tiny-llama", **TINY_MOE).save(tmp_path)
    plan(str(tmp_path), devices=2, precision="32-true")
    lines = capsys.readouterr().out.splitlines()
    estimate = estimate_memory(
        Config.from_checkpoint(tmp_path), devices=2, precision="32-true", max_seq_length=1024
    )
    assert estimate.total < RUNTIME_BYTES == 370 * 2**20
    after_total = lines[lines.index(f"total{estimate.total / 2**30:>22.2f}") + 1 :]
    assert after_total[0] == (
        "runtime                0.36  per process, not in the total: Python, torch and Lightning (measured on a CPU)"
    )
    assert after_total[1] == (
        f"A CPU process peaks near total + runtime = {(estimate.total + RUNTIME_BYTES) / 2**30:.2f} GiB. On a GPU "
        "the runtime is host memory, and the CUDA context takes about 0.37 GiB more of each device (PyTorch's "
        "figure, not measured here)."
    )


def test_plan_reads_a_checkpoint_directory(tmp_path, capsys):
    Config.from_name("tiny-llama").save(tmp_path)
    plan(str(tmp_path), device_memory="1GiB")
    out = capsys.readouterr().out
    assert out.startswith("tiny-llama (158K parameters)")
    assert "\nfits: " in out


def test_plan_rejects_zero_devices():
    with pytest.raises(LitsftError) as error:
        plan("tiny-llama", devices=0)
    assert str(error.value) == "--devices must be at least 1, got 0"


def test_lora_base_in_bf16_on_one_gpu():
    """bf16-mixed LoRA on one device: the frozen base takes 2 bytes per parameter and needs no compute copy;
    peak memory is below full fine-tuning's by more than the fp32 base copy."""
    config = Config.from_name("Llama-3.2-1B")
    N = num_parameters(config)
    # Rank 16 on all-linear: q and o 2048 + 2048, k and v 2048 + 512, gate, up and down 2048 + 8192.
    adapters = 16 * 16 * (2 * (2048 + 2048) + 2 * (2048 + 512) + 3 * (2048 + 8192))
    assert adapters == 11_272_192
    lora = estimate_memory(config, lora=LoRAConfig(rank=16), max_seq_length=4096)
    full = estimate_memory(config, max_seq_length=4096)
    assert lora.parameters == N * 2 + adapters * 4
    logits = 512 * config.vocab_size * (2 + 12)  # the loss's chunks of 512 tokens for a 128k vocabulary
    assert lora.transients == adapters * 2 + logits  # autocast casts the fp32 adapters only
    assert full.transients == N * 2 + logits
    assert full.total - lora.total > N * 4


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_adapter_parameters_and_buffers_of_every_variant(variant):
    """A and B per adapted projection (litsft.model.accounting.flops' formula), plus DoRA's magnitude per output row; PiSSA
    also keeps its initial A and B, fp32 buffers that FSDP2 does not shard: on every device, in full."""
    config = Config.from_name("tiny-llama")
    targets = ["q", "v", "down"]
    lora = LoRAConfig(rank=4, targets=targets, variant=variant)
    a_and_b = lora_parameters(config, targets, 4)
    rows = sum(layer.linear[t][1] for layer in model_sizes(config).layers for t in targets)
    assert adapter_parameters(config, lora) == a_and_b + (rows if variant == "dora" else 0)
    assert adapter_buffer_bytes(config, lora) == (4 * a_and_b if variant == "pissa" else 0)
    plain = estimate_memory(config, devices=2, lora=LoRAConfig(rank=4, targets=targets))
    estimate = estimate_memory(config, devices=2, lora=lora)
    assert estimate.parameters - plain.parameters == (
        4 * a_and_b if variant == "pissa" else math.ceil(4 * (rows if variant == "dora" else 0) / 2)
    )


def test_qlora_stores_the_adapted_projections_in_4_bits_plus_scales():
    """--quantize nf4: the adapted block projections take NF4_BYTES_PER_WEIGHT instead of 2 bytes, sharded
    and all-gathered like that, and the largest one is dequantized for its matmul (a transient)."""
    config = Config.from_name("Llama-2-70b-hf")
    lora = LoRAConfig(rank=16)
    projections = [
        fan_in * fan_out for layer in model_sizes(config).layers for fan_in, fan_out in layer.linear.values()
    ]
    assert sum(projections) == LLAMA_2_70B - 2 * 32000 * 8192 - 8192 * (
        2 * 80 + 1
    )  # all but embeddings, norms
    assert NF4_BYTES_PER_WEIGHT == 0.5 + 1 / 64 + 4 / (64 * 256)
    plain = estimate_memory(config, devices=8, lora=lora, activation_checkpointing=True)
    qlora = estimate_memory(config, devices=8, lora=lora, activation_checkpointing=True, quantize="nf4")
    saved = 2 - NF4_BYTES_PER_WEIGHT
    assert plain.parameters - qlora.parameters == pytest.approx(sum(projections) * saved / 8, abs=2)
    per_block = sum(projections) // config.num_layers
    assert qlora.transients - plain.transients == pytest.approx(
        max(projections) * NF4_DEQUANTIZE_BYTES - PREFETCHED_BLOCKS * per_block * saved, abs=2
    )
    assert (qlora.activations, qlora.gradients, qlora.optimizer_states) == (
        plain.activations, plain.gradients, plain.optimizer_states
    )  # fmt: skip
    with pytest.raises(LitsftError, match="--quantize nf4 applies to LoRA's frozen base"):
        estimate_memory(config, quantize="nf4")


def test_qlora_loading_holds_the_largest_weight_in_fp32_and_torchaos_working_memory():
    """Loading quantizes each NF4 weight whole: besides the parameters it holds the weight in fp32 and what
    torchao's quantization works in (distances to the 16 NF4 levels for 2**20 values at a time), counted here
    by torch's MemTracker around `load_nf4_weight` of the model's largest weight read in bf16. For a small
    model at a short sequence that, not a training step, is the peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    nf4_tensor = sys.modules[torchao_nf4().to_nf4.__module__]  # where this torchao keeps it
    assert NF4_QUANTIZE_CHUNK_VALUES == nf4_tensor.CHUNK_SIZE
    config = Config.from_name(
        "demo-llama", num_layers=2, hidden_size=512, intermediate_size=2816, num_heads=8, num_kv_heads=2,
        head_dim=64, vocab_size=256,
    )  # fmt: skip
    estimate = estimate_memory(
        config, devices=2, precision="32-true", max_seq_length=64, lora=LoRAConfig(rank=8), quantize="nf4"
    )
    in_features, out_features = max(
        (shape for layer in model_sizes(config).layers for shape in layer.linear.values()),
        key=lambda shape: shape[0] * shape[1],
    )
    assert in_features * out_features > NF4_QUANTIZE_CHUNK_VALUES  # the chunk is a fixed share of it
    linear = NF4Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = torch.nn.Parameter(to_nf4(torch.zeros(out_features, in_features)), requires_grad=False)
    stored = torch.randn(out_features, in_features).to(torch.bfloat16)  # as a checkpoint holds it
    tracker = MemTracker()
    tracker.track_external(linear)
    with tracker:
        held_before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        load_nf4_weight(linear, stored)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak - held_before == pytest.approx(estimate.loading, rel=0.002)
    assert estimate.total == estimate.parameters + estimate.loading > estimate.step


def test_70b_qlora_on_8x80gb(capsys):
    main(["plan", "Llama-2-70b-hf", "--devices", "8", "--lora.rank", "16", "--quantize", "nf4",
          "--fsdp.activation_checkpointing", "true", "--device_memory", "80GB"])  # fmt: skip
    out = capsys.readouterr().out
    assert "QLoRA rank 16 on q, k, v, o, gate, up, down, base in NF4, bf16-mixed" in out
    assert "parameters             4.33" in out and "\nfits: 15.29 GiB needed" in out


def test_plan_reads_a_recipe_yaml(capsys):
    """`litsft plan --config` plans what the recipe's YAML runs: 4 devices, FULL_SHARD with activation
    checkpointing, rank-16 all-linear adapters, micro batch 4 x 2048, 64 / (4 x 4) = 4 accumulation steps."""
    path = Path(__file__).parents[1] / "config_hub/finetune_lora/llama-3.1-8b.yaml"
    main(["plan", "--config", str(path), "--device_memory", "80GB"])
    out = capsys.readouterr().out
    expected = estimate_memory(
        Config.from_name("Llama-3.1-8B"), devices=4, micro_batch_size=4, max_seq_length=2048,
        activation_checkpointing=True, lora=LoRAConfig(rank=16), accumulation_steps=4,
    )  # fmt: skip
    assert out.startswith(
        "Llama-3.1-8B (8.03B parameters), LoRA rank 16 on q, k, v, o, gate, up, down, bf16-mixed"
    )
    assert "gradients + activations + transients" in out  # accumulating
    assert out.strip().endswith(
        f"fits: {expected.total / 2**30:.2f} GiB needed, 67.06 GiB usable of 80GB (90%)"
    )


def test_plan_refuses_a_global_batch_the_recipe_refuses():
    with pytest.raises(LitsftError) as error:
        plan("tiny-llama", devices=8, train=TrainConfig(global_batch_size=16, micro_batch_size=4))
    assert str(error.value).startswith(
        "--train.global_batch_size=16 is not divisible by --train.micro_batch_size=4"
    )


def test_plan_says_accumulated_gradients_stay_sharded(capsys):
    """The engine reduce-scatters every micro-batch's gradients: accumulating, each device holds its fp32
    shard of them (an eighth on 8 devices), and the plan names the whole-gradient size that waiting for the
    last micro-batch would cost."""
    config = Config.from_name("Llama-3.1-8B")
    estimate = estimate_memory(config, devices=8, accumulation_steps=4)
    assert estimate.whole_gradients == 4 * num_parameters(config)
    assert estimate.gradients == -(-estimate.whole_gradients // 8)
    train = TrainConfig(global_batch_size=64, micro_batch_size=2)
    plan("Llama-3.1-8B", devices=8, train=train)
    assert (
        "gradient accumulation over 4 micro-batches: gradients reduce-scattered after each one, so they stay "
        "sharded (3.74 GiB; held whole until the last one they would take 29.92 GiB)"
    ) in capsys.readouterr().out.splitlines()
    plan("Llama-3.1-8B", devices=8, train=train, fsdp=FSDPConfig(sharding_strategy="NO_SHARD"))
    assert (
        "gradient accumulation over 4 micro-batches: gradients all-reduced after the last one (NO_SHARD holds "
        "them whole anyway: 29.92 GiB)"
    ) in capsys.readouterr().out.splitlines()
    plan("Llama-3.1-8B", devices=8, train=TrainConfig(global_batch_size=16, micro_batch_size=2))
    assert "gradient accumulation" not in capsys.readouterr().out  # one micro-batch a step


@pytest.mark.parametrize(
    ("gpu", "precision", "expected"),
    [
        (("Tesla V100-SXM2-16GB", False), "16-mixed", "GPU (Tesla V100-SXM2-16GB) has no bf16: 16-mixed"),
        (("Tesla V100-SXM2-16GB", False), None, "has no bf16, so training refuses --precision bf16-mixed"),
        (("NVIDIA A100-SXM4-80GB", True), "16-mixed", None),
        (None, "bf16-mixed", None),
    ],
)
def test_a_plan_made_on_a_gpu_without_bf16_says_so(gpu, precision, expected, capsys, monkeypatch):
    """On a V100-class card (no bf16 units) the plan says the card has no bf16, whatever precision it plans."""
    import litsft.training.plan as plan_module

    monkeypatch.setattr(plan_module, "local_gpu", lambda: gpu)
    main(["plan", "Llama-3.2-1B", *(["--precision", precision] if precision else [])])
    out = capsys.readouterr().out
    if expected is None:
        assert "no bf16" not in out
    else:
        assert expected in out


def test_plan_counts_lora_on_a_mixture_of_experts_experts(capsys):
    """Naming the experts adds their adapters to the plan: the method line says so, the model the planner
    measures has E x r x (C + 2I + I + C) more trained parameters per block (A and B of both fused
    projections), and the optimizer states grow by their fp32 AdamW moments, sharded over 8."""
    from litsft.model.lora.layers import apply_lora
    from litsft.model.network.transformer import Transformer

    config = Config.from_name("Qwen3-30B-A3B")
    attention = LoRAConfig(rank=16, targets=["q", "k", "v", "o"])
    experts = LoRAConfig(rank=16, dropout=0.0, targets=["q", "k", "v", "o", "experts"])

    def trained(lora: LoRAConfig) -> int:
        with torch.device("meta"):
            model = apply_lora(Transformer(config), lora)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    per_block = config.num_experts * 16 * (2 * config.hidden_size + 3 * config.expert_intermediate)
    assert trained(experts) - trained(attention) == per_block * config.num_layers
    grown = estimate_memory(config, devices=8, lora=experts).optimizer_states
    grown -= estimate_memory(config, devices=8, lora=attention).optimizer_states
    assert grown == pytest.approx(per_block * config.num_layers * 8 / 8, rel=0.01)
    main(["plan", "Qwen3-30B-A3B", "--devices", "8", "--lora.rank", "16", "--lora.dropout", "0",
          "--lora.targets", "[q, k, v, o, experts]", "--device_memory", "80GB"])  # fmt: skip
    assert "LoRA rank 16 on q, k, v, o, experts, bf16-mixed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("precision", "lora"),
    [("32-true", None), ("bf16-true", None), ("bf16-mixed", LoRAConfig(rank=4, targets="all-linear"))],
)
def test_the_planned_checkpoint_is_what_a_checkpoint_of_the_built_model_and_optimizer_holds(precision, lora):
    """The plan's step-checkpoint bytes against the tensors litsft's checkpoint stores for the model and
    optimizer the recipe builds: every trained weight in its stored dtype, AdamW's moments, bf16-true's
    compensation buffers; LoRA's adapters only. AdamW's 0-dim step counts are left out of both."""
    from litsft.checkpoint.training_checkpoint import checkpoint_tensors
    from litsft.training.args import OptimizerConfig
    from litsft.training.optimizer import build_optimizer

    config = Config.from_name("tiny-llama")
    model = Transformer(config).to(torch.bfloat16 if precision == "bf16-true" else torch.float32)
    if lora is not None:
        model = apply_lora(model, lora)
    optimizer = build_optimizer(model, OptimizerConfig())
    for param in model.parameters():
        param.grad = torch.zeros_like(param) if param.requires_grad else None
    optimizer.step()  # creates the optimizer's states
    stored = checkpoint_tensors(model, optimizer, with_frozen=lora is None)
    held = sum(t.numel() * t.element_size() for t in stored.values() if t.dim() > 0)

    estimate = estimate_memory(config, precision=precision, lora=lora)
    assert estimate.whole_checkpoint == estimate.checkpoint == held
    sharded = estimate_memory(config, devices=4, precision=precision, lora=lora)
    assert (sharded.whole_checkpoint, sharded.checkpoint) == (held, math.ceil(held / 4))
    hybrid = estimate_memory(
        config, devices=4, num_nodes=2, sharding_strategy="HYBRID_SHARD", precision=precision, lora=lora
    )
    assert (hybrid.whole_checkpoint, hybrid.checkpoint) == (held, math.ceil(held / 4))


def test_plan_says_what_a_step_checkpoint_takes_on_disk_and_in_a_nodes_host_memory(capsys):
    plan("Llama-3.1-8B", devices=8)
    parameters = Config.from_name("Llama-3.1-8B")
    whole = num_parameters(parameters) * (4 + 2 * 4)  # fp32 weights and AdamW's two fp32 moments
    assert (
        f"step checkpoint: {whole / 2**30:.2f} GiB on disk; a background save (--train.async_save) keeps "
        f"{whole / 2**30:.2f} GiB of host memory per node (8 x {whole / 8 / 2**30:.2f} GiB) until it is written"
    ) in capsys.readouterr().out.splitlines()


def test_context_parallelism_halves_activations_and_keeps_the_parameter_shards():
    """With --parallel.context 2 each rank holds half of every row: activations drop to about half (the
    all-to-all's transients come on top), while parameters stay sharded over every rank, context ranks
    included, and a micro-batch of 65537 tokens is padded to 2 x 32769 (RoPE's tables stay whole)."""
    config = Config.from_name("Llama-3.1-8B")
    for checkpointing in (False, True):
        one = estimate_memory(config, devices=8, max_seq_length=65536, activation_checkpointing=checkpointing)
        two = estimate_memory(
            config, devices=8, max_seq_length=65536, activation_checkpointing=checkpointing, context=2
        )
        assert two.activations / one.activations == pytest.approx(0.5, rel=0.01), checkpointing
        assert two.transients > one.transients
        assert (two.parameters, two.gradients, two.optimizer_states) == (
            one.parameters, one.gradients, one.optimizer_states
        )  # fmt: skip
    odd = estimate_memory(config, devices=8, max_seq_length=65537, context=2)
    even = estimate_memory(config, devices=8, max_seq_length=65538, context=2)
    # The same 32769 tokens on each rank; RoPE's cos and sin (bf16) are made for the whole row, one token more.
    assert even.activations - odd.activations == 2 * config.head_dim * 2


def test_context_parallelism_counts_repeated_kv_heads_when_the_context_does_not_divide_them(monkeypatch):
    """Llama-3.1-8B has 8 kv heads: context 8 splits them (one a rank), context 16 repeats them to 16 first,
    and every layer saves the repeated heads' k and v for the whole sequence (1/16 of a head's worth per
    rank each), on top of its q, k, v and output in both layouts at attention time."""
    import litsft.training.plan as plan_module

    config = Config.from_name("Llama-3.1-8B")
    tokens, head = 4096, 4096 * 128 * 2  # a rank's tokens; one head over them in bf16
    assert context_attention_bytes(config, tokens, 2, 1) == (0, 0)
    assert context_attention_bytes(config, tokens, 2, 8) == (0, 2 * (2 * 32 + 2 * 8) * head)
    assert context_attention_bytes(config, tokens, 2, 16) == (2 * 8 * head, 2 * (2 * 32 + 2 * 16) * head)
    repeated = estimate_memory(config, devices=16, max_seq_length=16 * tokens, context=16)
    monkeypatch.setattr(plan_module, "context_kv_heads", lambda num_kv_heads, context: num_kv_heads)
    split = estimate_memory(config, devices=16, max_seq_length=16 * tokens, context=16)
    assert repeated.activations - split.activations == 32 * 2 * 8 * head
    assert repeated.transients - split.transients == 2 * 2 * 8 * head


@pytest.mark.parametrize(
    ("model", "devices", "option", "size", "message"),
    [
        ("Llama-3.1-8B", 8, "context", 3, "--parallel.context=3 does not divide --devices=8: a context group is "
         "made of ranks of one node; pick one of 1, 2, 4, 8"),
        ("Qwen2.5-7B", 8, "context", 8, "--parallel.context=8 does not divide Qwen2.5-7B's 28 attention heads: "
         "each context rank attends with an equal share of them; pick one of 1, 2, 4"),
        ("Llama-3.1-8B", 8, "context", 0, "--parallel.context=0: it is a number of ranks, at least 1"),
        ("Qwen3-30B-A3B", 8, "expert", 3, "--parallel.expert=3 does not divide the shard group of 8 ranks "
         "(--devices=8 x --num_nodes=1): an expert group splits the ranks that shard the weights; pick one of 1, "
         "2, 4, 8"),
        ("Qwen3-30B-A3B", 12, "expert", 3, "--parallel.expert=3 does not divide Qwen3-30B-A3B's 128 experts: "
         "each expert rank owns an equal share of them; pick one of 1, 2, 4"),
        ("Llama-3.1-8B", 8, "expert", 2, "--parallel.expert=2: Llama-3.1-8B has no experts (not a mixture of "
         "experts); drop it"),
    ],
)  # fmt: skip
def test_plan_refuses_a_parallel_size_training_refuses(model, devices, option, size, message, capsys):
    """The planner refuses in the words of training's own refusal, called and from the command line."""
    with pytest.raises(LitsftError) as error:
        estimate_memory(Config.from_name(model), devices=devices, **{option: size})
    assert str(error.value) == message
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", model, "--devices", str(devices), f"--parallel.{option}", str(size)])
    assert exit_info.value.code != 0
    assert capsys.readouterr().err == f"error: {message}\n"


def test_plan_prints_the_context_layout_and_accumulates_over_data_replicas(capsys):
    """8 devices in context groups of 4 are 2 data replicas: a global batch of 8 rows, one per micro-batch,
    takes 4 micro-batches on each."""
    main(["plan", "Llama-3.1-8B", "--devices", "8", "--parallel.context", "4", "--train.max_seq_length", "131072",
          "--train.global_batch_size", "8", "--train.micro_batch_size", "1"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert "8 device(s) x 1 node(s): FULL_SHARD, shard group 8, context 4 x data 2" in lines
    assert (
        "micro batch 1 x 131072 tokens (32768 a micro-batch on each rank of a context group), without activation "
        "checkpointing" in lines
    )
    assert any(line.startswith("gradient accumulation over 4 micro-batches") for line in lines)


def test_expert_parallelism_gathers_an_eighth_of_the_experts_and_keeps_the_shards(capsys):
    """Qwen3-30B-A3B at --parallel.expert 8 on 8 devices: the experts rest in the same 1/8 shards (efsdp 1 x
    expert 8), but a block's all-gather brings a rank its own 16 experts, not all 128: the gathered experts
    (two blocks held, bf16) and one block's expert gradient buffers (bf16 and fp32) drop 8-fold, and each MoE
    layer's dispatch buffers come on top (tokens x k rows received and as many sent back, bf16)."""
    config = Config.from_name("Qwen3-30B-A3B")
    one = estimate_memory(config, devices=8)
    eight = estimate_memory(config, devices=8, expert=8)
    assert (eight.parameters, eight.gradients, eight.optimizer_states, eight.activations) == (
        one.parameters, one.gradients, one.optimizer_states, one.activations
    )  # fmt: skip
    experts = max(layer.expert_weights for layer in model_sizes(config).layers)  # one block's 128 experts
    gathered_one, gathered_eight = 2 * experts * 2, 2 * (experts // 8) * 2
    assert gathered_one / gathered_eight == 8
    dispatch = expert_dispatch_bytes(config, 2048, 2, 8)
    assert dispatch == 2 * 2048 * 8 * 2048 * 2
    buffers = experts * 7 // 8 * (2 + 4)
    assert one.transients - eight.transients == gathered_one - gathered_eight + buffers - dispatch
    assert eight.transients < one.transients / 2
    main(["plan", "Qwen3-30B-A3B", "--devices", "8", "--parallel.expert", "8", "--device_memory", "80GB"])
    lines = capsys.readouterr().out.splitlines()
    assert "8 device(s) x 1 node(s): FULL_SHARD, shard group 8, expert 8 x expert-fsdp 1" in lines
    assert any(
        line.startswith("expert parallelism: each rank computes 16 of every MoE layer's 128 experts")
        for line in lines
    )


def test_a_preference_objective_on_unpacked_pairs_plans_two_rows_a_pair(capsys):
    """Unpacked, a micro-batch of pairs is twice as many rows (chosen and rejected): planned so, with more
    activations than SFT's; packed, rows hold both sequences and the plan is SFT's."""
    from litsft.data import JSON
    from litsft.training.args import ObjectiveConfig

    train = TrainConfig(micro_batch_size=2, global_batch_size=2, max_seq_length=1024)
    needed = {}
    for name, objective, packing in (
        ("sft", None, False),
        ("dpo packed", ObjectiveConfig(name="dpo"), True),
        ("dpo unpacked", ObjectiveConfig(name="dpo"), False),
    ):
        data = JSON(json_path=Path("unused.json"), packing=packing)
        plan("Llama-3.2-1B", train=train, data=data, objective=objective, device_memory="80GB")
        out = capsys.readouterr().out
        needed[name] = float(re.search(r"fits: ([\d.]+) GiB needed", out).group(1))
        if objective is not None:
            assert "objective dpo:" in out and "reference scored once before training" in out
        assert ("micro batch 4 x 1024 tokens" in out) == (name == "dpo unpacked"), name
    assert needed["dpo packed"] == needed["sft"] < needed["dpo unpacked"]
