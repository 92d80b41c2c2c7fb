import inspect
from typing import get_args

import pytest

from litsft import parallel
from litsft.config import Config
from litsft.errors import LitsftError
from litsft.model import chunked_cross_entropy
from litsft.plan import (
    LOSS_CHUNK_TOKENS,
    Precision,
    ShardingStrategy,
    block_activation_bytes_per_token,
    block_parameters,
    estimate_memory,
    fits,
    parse_memory_size,
    plan,
    root_parameters,
)

LLAMA_2_7B = 6_738_415_616
LLAMA_2_70B = 68_976_648_192
GB = 10**9


def test_choices_match_the_engine():
    assert get_args(ShardingStrategy) == get_args(parallel.ShardingStrategy)
    assert get_args(Precision) == get_args(parallel.Precision)


def test_loss_chunk_matches_the_model():
    assert inspect.signature(chunked_cross_entropy).parameters["chunk_size"].default == LOSS_CHUNK_TOKENS


def test_parameter_split_adds_up():
    config = Config.from_name("Llama-2-7b-hf")
    assert root_parameters(config) == 2 * 32000 * 4096 + 4096
    assert block_parameters(config) * 32 + root_parameters(config) == LLAMA_2_7B


def test_full_shard_bf16_mixed_divides_fp32_states_by_eight():
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8)
    assert estimate.parameters == LLAMA_2_7B * 4 // 8 == 3_369_207_808
    assert estimate.gradients == LLAMA_2_7B * 4 // 8
    assert estimate.optimizer_states == 2 * LLAMA_2_7B * 4 // 8


def test_bf16_true_keeps_everything_in_two_bytes():
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, precision="bf16-true")
    assert (estimate.parameters, estimate.gradients, estimate.optimizer_states) == (
        LLAMA_2_7B * 2 // 8,
        LLAMA_2_7B * 2 // 8,
        LLAMA_2_7B * 4 // 8,
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
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8)
    assert fits(estimate, 80 * GB)


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
    # LoRA in bf16-true: the frozen base is 2 bytes per parameter, 17.2 GB per device.
    lora = estimate_memory(config, devices=8, precision="bf16-true", lora=True, activation_checkpointing=True)
    adapters = 80 * 8 * ((8192 + 8192) + 2 * (8192 + 1024) + (8192 + 8192))
    assert lora.parameters == (LLAMA_2_70B + adapters) * 2 // 8
    assert fits(lora, 80 * GB)


def test_lora_trains_only_the_adapters():
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8, lora=True, lora_rank=8)
    adapters = 32 * 8 * 4 * (4096 + 4096)  # rank 8 on q, k, v, o: 8,388,608
    assert adapters == 8_388_608
    # bf16-mixed: the frozen base in bf16 (2 bytes), the adapters in fp32 (4 bytes).
    assert estimate.parameters == (LLAMA_2_7B * 2 + adapters * 4) // 8
    assert estimate.gradients == adapters * 4 // 8
    assert estimate.optimizer_states == adapters * 8 // 8


def test_llama_block_activations_by_hand():
    config = Config.from_name("Llama-2-7b-hf")
    norms = 2 * (4 * 4096 + 2 * 4096)  # fp32 upcast + bf16 output, twice
    attention = 5 * 4096 * 2 + 4 * 32  # q, k, v, attention output, o_proj input + logsumexp
    mlp = 4 * 11008 * 2  # gate, silu, up, product
    assert block_activation_bytes_per_token(config, 2) == norms + attention + mlp == 178_304
    # LoRA: frozen MLP projections keep neither the MLP norm output nor the product; adapters keep A's output.
    lora = block_activation_bytes_per_token(config, 2, lora=True, lora_rank=8)
    assert lora == 178_304 - 2 * 4096 - 2 * 11008 + 4 * 8 * 2


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    config = Config.from_name("Llama-2-7b-hf")
    head = 2048 * (4096 * 6 + 2 * 128 * 2)  # final norm, RoPE cos and sin
    plain = estimate_memory(config, devices=8)
    assert plain.activations == 32 * 178_304 * 2048 + head
    checkpointed = estimate_memory(config, devices=8, activation_checkpointing=True)
    assert checkpointed.activations == 32 * 2048 * 4096 * 2 + 178_304 * 2048 + head == 953_417_728


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
    # then the larger of gradients (3.14 GiB) and activations + transients (10.93 + 3.23 GiB).
    estimate = estimate_memory(Config.from_name("Llama-2-7b-hf"), devices=8)
    assert estimate.total == (
        estimate.parameters + estimate.optimizer_states + estimate.activations + estimate.transients
    )
    assert round(estimate.total / 2**30, 2) == 23.57
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
    plan("Llama-2-7b-hf", devices=8, sharding_strategy="NO_SHARD", device_memory="80GB")
    out = capsys.readouterr().out
    assert "Llama-2-7b-hf (6.74B parameters), full fine-tuning, bf16-mixed" in out
    assert "optimizer states      50.21" in out.splitlines()
    assert out.strip().endswith("does not fit: 100.41 GiB needed, 67.06 GiB usable of 80GB (90%)")


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
    N = config.num_parameters
    adapters = 16 * 16 * ((2048 + 2048) + 2 * (2048 + 512) + (2048 + 2048))  # rank 16 on q, k, v, o
    lora = estimate_memory(config, lora=True, lora_rank=16, max_seq_length=4096)
    full = estimate_memory(config, max_seq_length=4096)
    assert lora.parameters == N * 2 + adapters * 4
    logits = LOSS_CHUNK_TOKENS * config.vocab_size * (2 + 12)
    assert lora.transients == adapters * 2 + logits  # autocast casts the fp32 adapters only
    assert full.transients == N * 2 + logits
    assert full.total - lora.total > N * 4
