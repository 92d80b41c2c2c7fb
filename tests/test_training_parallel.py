"""litsft/training/parallel.py: what `parallelize` does to a model, on one process and on CPU meshes of forked
processes (sharding is also checked end to end by the distributed-equivalence tests in test_training_engine.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import DEADLINE_S, on_ranks
from torch import nn

from litsft.model.config import Config
from litsft.model.network.transformer import Transformer
from litsft.training.args import FSDPConfig
from litsft.training.parallel import parallelize


def model_and_batch() -> tuple[Transformer, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    model.init_weights(1)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    return model, {"input_ids": tokens, "labels": tokens}


def test_float8_is_applied_first_and_keeps_the_names() -> None:
    """`parallelize` swaps the large block projections for float8 ones before compiling (compile traces the
    float8 casts), one process: no FSDP, so no float8 all-gather wrapper on the weights."""
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        model = Transformer(Config.from_name("Llama-3.2-1B", num_layers=2))
    names = [name for name, _ in model.named_parameters()]
    parallelize(model, None, FSDPConfig(), "bf16-mixed", compile_blocks=True, float8="tensorwise")
    assert [name for name, _ in model.named_parameters()] == names
    converted = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    assert len(converted) == 2 * 5 and "lm_head" not in converted
    assert type(model.blocks[0].mlp.up_proj.weight).__name__ == "Parameter"
    assert model.loss_compiled


def test_activation_checkpointing_recomputes_blocks_with_the_same_loss_gradients_and_names() -> None:
    reference, batch = model_and_batch()
    checkpointed, _ = model_and_batch()
    names = [name for name, _ in checkpointed.named_parameters()]
    parallelize(checkpointed, None, FSDPConfig(activation_checkpointing=True), "32-true")
    assert [name for name, _ in checkpointed.named_parameters()] == names

    calls = []
    checkpointed.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
    losses = []
    for model in (reference, checkpointed):
        loss = model(**batch)
        loss.backward()
        losses.append(loss.detach())
    assert len(calls) == 2  # the forward pass, and again in the backward pass
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(reference.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)

    calls.clear()
    with torch.no_grad():
        checkpointed.eval()(**batch)
    assert len(calls) == 1  # nothing to recompute outside training


# ---- several processes on a CPU mesh -----------------------------------------------------------------------
def _micro_batch(rank: int, index: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(100 * rank + index))
    return {"input_ids": tokens, "labels": tokens}


MESHES = {"FULL_SHARD": (2,), "HYBRID_SHARD": (2, 2)}
"""The mesh each case runs on: 2 ranks sharding; 2 nodes x 2 devices, sharding in a node, replicating across."""


def _sharded_facts(strategy: str, lora: bool) -> dict:
    """Gradient accumulation over 3 micro-batches, as the training step does it (`synchronize_gradients`
    before each): what the gradients are after each micro-batch, how many FSDP units the model has, and how
    far the accumulated gradients are from one process's on all the data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from litsft.model.lora.layers import LoRAConfig, apply_lora
    from litsft.training.parallel import synchronize_gradients

    rank = dist.get_rank()

    def build() -> Transformer:
        model, _ = model_and_batch()
        if lora:
            model = apply_lora(model, LoRAConfig(rank=4, alpha=8, dropout=0.0, targets="all-linear"))
            for name, param in model.named_parameters():  # non-zero adapters: every gradient is non-zero
                if "lora_" in name:
                    param.data = torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name)))
        return model

    shape = MESHES[strategy]
    ranks = math.prod(shape)
    reference, model = build(), build()
    names = ("replicate", "shard") if len(shape) == 2 else None
    parallelize(model, init_device_mesh("cpu", shape, mesh_dim_names=names), FSDPConfig(sharding_strategy=strategy), "32-true")  # fmt: skip
    facts: dict = {"units": sum(isinstance(m, FSDPModule) for m in model.modules()), "after_micro_batch": []}
    trained = {name: param for name, param in model.named_parameters() if param.requires_grad}
    with (
        torch.no_grad()
    ):  # a validation pass first, as between training steps: unresharded units stay gathered
        model.eval()(_micro_batch(rank, 9)["input_ids"])
    model.train()
    facts["trained_elements"] = sum(param.numel() for param in trained.values())
    facts["trained_tensors"] = len(trained)
    for index in range(3):
        synchronize_gradients(model, strategy, last_micro_batch=index == 2)
        model(**_micro_batch(rank, index)).backward()
        shards = all(
            isinstance(param.grad, DTensor)
            and param.grad.placements == param.placements
            and param.grad.to_local().shape == param.to_local().shape
            and param.to_local().numel() < param.numel()
            for param in trained.values()
            if param.numel() > 1  # a 1-element tensor is not split; it stays sharded on one rank
        )
        facts["after_micro_batch"].append((shards, *_gradient_elements(model)))
    # FSDP averages over the ranks: the reference sums every micro-batch of every rank and divides.
    for index in range(3):
        for other in range(ranks):
            (reference(**_micro_batch(other, index)) / ranks).backward()
    expected = dict(reference.named_parameters())
    facts["max_difference"] = max(
        (param.grad.full_tensor() - expected[name].grad).abs().max().item() for name, param in trained.items()
    )
    facts["frozen_grads"] = sum(
        param.grad is not None for param in model.parameters() if not param.requires_grad
    )
    return facts


def _gradient_elements(model: nn.Module) -> tuple[int, int]:
    """(whole, sharded): elements of the unsharded gradients FSDP2 holds for the next micro-batch, and of the
    sharded ones (the parameters' gradient shards, HYBRID_SHARD's reduce-scattered shards awaiting their
    all-reduce). FSDP2 has no public view of what it holds between micro-batches: read from its state."""
    from torch.distributed.fsdp import FSDPModule

    whole = sharded = 0
    for unit in model.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            for gradient in (
                fsdp_param.unsharded_accumulated_grad,
                getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None),
            ):
                whole += gradient.numel() if gradient is not None else 0
        if group._partial_reduce_output is not None:
            sharded += group._partial_reduce_output.numel()
    sharded += sum(param.grad.to_local().numel() for param in model.parameters() if param.grad is not None)
    return whole, sharded


@pytest.mark.parametrize(
    ("strategy", "lora"), [("FULL_SHARD", False), ("FULL_SHARD", True), ("HYBRID_SHARD", False)]
)
def test_accumulation_keeps_sharded_gradients_in_one_unit_per_block(
    tmp_path, strategy: str, lora: bool
) -> None:
    """Each micro-batch's gradients are reduce-scattered (under HYBRID_SHARD within a node, all-reduced across
    nodes after the last micro-batch only): after every micro-batch, not only the last, each rank holds its
    shard of every gradient (a DTensor of the parameter's local shape), never the whole gradient, and the
    accumulated result equals one process's over all the data. A LoRA model is one FSDP unit per block plus
    the root (not one per adapter matrix), its frozen base gets no gradient."""
    ranks = range(math.prod(MESHES[strategy]))
    facts = on_ranks(len(ranks), _sharded_facts, tmp_path, strategy, lora)
    shard_group = MESHES[strategy][-1]
    for rank in ranks:
        assert isinstance(facts[rank], dict), facts[rank]
        trained, tensors = facts[rank]["trained_elements"], facts[rank]["trained_tensors"]
        for index, (shards, whole, sharded) in enumerate(facts[rank]["after_micro_batch"]):
            # HYBRID_SHARD holds its shards aside until the last micro-batch's all-reduce; then, and under
            # FULL_SHARD after every micro-batch, they are the parameters' gradients.
            assert shards == (index == 2 or strategy == "FULL_SHARD"), (index, facts[rank])
            assert whole == 0, (index, facts[rank])
            assert 0 < sharded <= trained / shard_group + tensors, (
                index,
                facts[rank],
            )  # rows of an uneven split
        assert facts[rank]["max_difference"] < 1e-5
        assert facts[rank]["units"] == Config.from_name("tiny-llama").num_layers + 1
        assert facts[rank]["frozen_grads"] == 0


FLOAT8_SHAPE = dict(num_layers=2, hidden_size=256, intermediate_size=1040, num_heads=4, num_kv_heads=2)
"""gate and up (1040 x 256) are large enough to become float8; the rest stays as it is."""


def _float8_facts(save_to: str) -> dict:
    """Three optimizer steps of tensorwise float8 on 2 ranks, FSDP2 all-gathering the weights in float8 with
    the scales precomputed after each update, against one process's float8 model on both ranks' data."""
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    from litsft.checkpoint.sharded_tensors import plain
    from litsft.model.precision.float8 import convert_to_float8, precompute_float8_scales

    rank = dist.get_rank()

    def build() -> Transformer:
        torch.manual_seed(0)
        model = Transformer(Config.from_name("tiny-llama", **FLOAT8_SHAPE))
        model.init_weights(1)
        return model

    reference, model = build(), build()
    convert_to_float8(reference, "tensorwise", fsdp_all_gather=False)
    parallelize(model, init_device_mesh("cpu", (2,)), FSDPConfig(), "32-true", float8="tensorwise")
    wrapped = type(model.blocks[0].mlp.up_proj.weight.to_local()).__name__
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(3):
        loss = model(**_micro_batch(rank, step))
        loss.backward()
        reference_loss = sum(reference(**_micro_batch(other, step)) / 2 for other in range(2))
        reference_loss.backward()  # FSDP averages the two ranks' gradients: so does the reference
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        precompute_float8_scales(model)
    gathered = {
        name: plain(t).full_tensor() for name, t in model.state_dict().items()
    }  # the wrapper comes off
    if rank == 0:
        save_file({name: tensor.contiguous() for name, tensor in gathered.items()}, save_to)
    expected = reference.state_dict()
    return {
        "wrapped": wrapped,
        "max_difference": max((gathered[name] - expected[name]).abs().max().item() for name in expected),
        "moved": max((gathered[name] - build().state_dict()[name]).abs().max().item() for name in expected),
    }


def test_two_processes_gather_float8_weights_and_train_like_one(tmp_path) -> None:
    """Tensorwise float8 sharded over 2 ranks (gloo on the CPU, where torch runs float8 matmuls too): the
    weights are all-gathered in float8 (torchao's wrapper around each converted weight's shard), the scales
    computed after each update, and after 3 steps the weights equal one process's float8 run on all the data;
    gathered for saving, they are plain tensors that safetensors writes."""
    from safetensors.torch import load_file

    save_to = str(tmp_path / "gathered.safetensors")
    facts = on_ranks(2, _float8_facts, tmp_path, save_to)
    for rank in range(2):
        assert isinstance(facts[rank], dict), facts[rank]
        assert facts[rank]["wrapped"] == "WeightWithDynamicFloat8CastTensor"
        assert facts[rank]["moved"] > 1e-3  # the steps changed the weights
        assert facts[rank]["max_difference"] < 1e-6, facts[rank]  # measured 0.0: the same float8 casts
    assert "blocks.0.mlp.up_proj.weight" in load_file(save_to)


@pytest.mark.parametrize(
    ("world_size", "precision", "cpu_offload", "accelerator", "refusal"),
    [
        (1, "bf16-mixed", True, "cuda", "--fsdp.cpu_offload needs 2 or more GPUs (it is FSDP's, and one GPU"),
        (2, "32-true", True, "cpu", "--fsdp.cpu_offload needs GPUs: on a CPU-only machine"),
        (8, "bf16-mixed", True, "cuda", None),
        (2, "16-mixed", False, "cuda", "--precision 16-mixed runs on one GPU only"),
        (1, "16-mixed", False, "cuda", None),
    ],
)
def test_fsdp_options_that_would_not_do_what_they_ask_are_refused(
    world_size, precision, cpu_offload, accelerator, refusal
):
    """One GPU trains without FSDP, so FSDP's CPU offload would be silently ignored there; FSDP2 takes no
    16-mixed. Both are refused in one line before anything starts (the device kind is made up: the check
    reads no hardware), and tutorials/sharding_strategies.md quotes the GPU refusals as the CLI prints them."""
    from litsft.cli.validation import check_fsdp_options
    from litsft.errors import LitsftError

    fsdp = FSDPConfig(cpu_offload=cpu_offload)
    if refusal is None:
        check_fsdp_options(world_size, precision, fsdp, accelerator)
        return
    with pytest.raises(LitsftError) as error:
        check_fsdp_options(world_size, precision, fsdp, accelerator)
    assert str(error.value).startswith(refusal)
    assert "\n" not in str(error.value)
    if accelerator == "cuda":
        tutorial = Path(__file__).resolve().parent.parent / "tutorials" / "sharding_strategies.md"
        assert f"error: {error.value}\n" in tutorial.read_text()


# ---- a mixture of experts, sharded along the expert dimension -------------------------------------------------
MOE_MESHES = {
    "FULL_SHARD on 2": ("FULL_SHARD", (2,)),
    "FULL_SHARD on 4": ("FULL_SHARD", (4,)),
    "SHARD_GRAD_OP on 2": ("SHARD_GRAD_OP", (2,)),
    "SHARD_GRAD_OP on 4": ("SHARD_GRAD_OP", (4,)),
    "HYBRID_SHARD on 2 x 2": ("HYBRID_SHARD", (2, 2)),
}
"""Test id -> (strategy, device mesh): 2 and 4 ranks, the 4 experts sharded 2 or 1 to a rank."""


def tiny_moe() -> Transformer:
    """tiny-llama's attention with Qwen3-MoE's routed MLP: 4 experts, 2 per token, the load-balancing loss on
    with a coefficient large enough to move the routers."""
    torch.manual_seed(0)
    config = Config.from_name(
        "tiny-llama",
        hf_architecture="Qwen3MoeForCausalLM",
        num_experts=4,
        experts_per_token=2,
        expert_intermediate_size=48,
        normalize_expert_weights=True,
        router_aux_loss_coef=0.1,
    )
    model = Transformer(config)
    model.init_weights(1)
    with torch.no_grad():  # routers far from uniform, so that routing decides which experts learn
        for block in model.blocks:
            block.mlp.router.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(7))
    return model


def _moe_micro_batch(rank: int, index: int) -> dict[str, torch.Tensor]:
    """Rank 1's first micro-batch is one token repeated: every position has the same hidden state in every
    layer, so its router sends all of them to the same 2 experts and the 2 others get no token there."""
    if rank == 1 and index == 0:
        tokens = torch.full((1, 16), 42)
    else:
        tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(100 * rank + index))
    return {"input_ids": tokens, "labels": tokens}


def _moe_sharded_facts(rank: int, case: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from litsft.model.network.moe import expert_load
    from litsft.training.parallel import synchronize_gradients

    strategy, shape = MOE_MESHES[case]
    ranks = math.prod(shape)
    reference, model = tiny_moe(), tiny_moe()
    names = ("replicate", "shard") if len(shape) == 2 else None
    parallelize(model, init_device_mesh("cpu", shape, mesh_dim_names=names), FSDPConfig(sharding_strategy=strategy), "32-true")  # fmt: skip
    experts = model.blocks[0].mlp.experts.gate_up_proj
    facts: dict = {"expert_rows": experts.to_local().shape[0], "unrouted": []}
    for index in range(2):
        synchronize_gradients(model, strategy, last_micro_batch=index == 1)
        model(**_moe_micro_batch(rank, index)).backward()
        unrouted = expert_load(model) == 0  # (layer, expert) pairs that received no token
        facts["unrouted"].append(int(unrouted.sum()))
    for index in range(2):
        for other in range(ranks):
            (reference(**_moe_micro_batch(other, index)) / ranks).backward()
    expected = dict(reference.named_parameters())
    facts["max_difference"] = max(
        (param.grad.full_tensor() - expected[name].grad).abs().max().item()
        for name, param in model.named_parameters()
    )
    facts["router_gradient"] = expected["blocks.1.mlp.router.weight"].grad.abs().max().item()
    return facts


def _moe_worker(rank: int, init_file: str, case: str, results) -> None:
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        world_size = math.prod(MOE_MESHES[case][1])
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        results.put((rank, _moe_sharded_facts(rank, case)))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("case", MOE_MESHES)
def test_sharded_experts_with_an_unrouted_expert_equal_one_process(tmp_path, case: str) -> None:
    """Experts sharded along the expert dimension (4 over each shard group of 2 or 4 ranks), the load-balancing
    loss on, and rank 1 routing no token to 2 experts of each layer in its first micro-batch: nothing waits
    forever (each rank's fused expert weights get a gradient, zero rows for the unrouted experts), and the
    accumulated gradients equal one process's over every micro-batch within 1e-5."""
    import torch.multiprocessing as mp

    context = mp.get_context("fork")
    results = context.Queue()
    _, shape = MOE_MESHES[case]
    ranks = range(math.prod(shape))
    workers = [
        context.Process(target=_moe_worker, args=(rank, str(tmp_path / "init"), case, results))
        for rank in ranks
    ]
    for worker in workers:
        worker.start()
    facts = dict(results.get(timeout=DEADLINE_S) for _ in workers)
    for worker in workers:
        worker.join(timeout=DEADLINE_S)
    for rank in ranks:
        assert isinstance(facts[rank], dict), facts[rank]
        assert facts[rank]["expert_rows"] == 4 // shape[-1]  # the experts split over the shard group
        assert facts[rank]["max_difference"] < 1e-5, facts[rank]
        assert facts[rank]["router_gradient"] > 1e-3  # the routers learn: the check above compares something
    assert facts[1]["unrouted"][0] == 2 * 2  # 2 experts in each of the 2 layers


def test_activation_checkpointing_keeps_an_moe_models_gradients_balancing_loss_included() -> None:
    """The routers' statistics leave each recomputed block for the load-balancing loss: checkpointed, every
    gradient is the one of the plain model."""
    reference, checkpointed = tiny_moe(), tiny_moe()
    parallelize(checkpointed, None, FSDPConfig(activation_checkpointing=True), "32-true")
    for model in (reference, checkpointed):
        model(**_moe_micro_batch(0, 0)).backward()
    for (name, a), b in zip(reference.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)
    assert reference.blocks[0].mlp.router.weight.grad.abs().max() > 1e-3
