"""litsft/model/network/expert_parallel.py: an MoE layer whose experts are split over expert groups of 2 and 4
gloo processes, each holding its own tokens, against one process holding all of them: the loss, the inputs'
and the router's gradients and each expert's weight and adapter gradients, on balanced and skewed routing
(every token to experts 0 and 1, so the ranks owning the others receive no row at all), with the experts'
weights normalized over the k chosen (Qwen3-MoE, Mixtral) and not (OLMoE)."""

from __future__ import annotations

import pytest
import torch
from launch import EXPERT_FAMILIES, on_ranks

from litsft.model.config import Config
from litsft.model.lora.layers import ExpertLoRA
from litsft.model.network.expert_parallel import ExpertShard, shard_experts
from litsft.model.network.moe import MoE

TOKENS = 12
"""Tokens per rank."""
CASES = [
    (family, skewed, lora)
    for family in ("qwen3-moe", "olmoe")
    for skewed in (False, True)
    for lora in (False, True)
]


def moe_layer(family: str, skewed: bool, lora: bool) -> MoE:
    """The family's tiny MoE layer (4 experts, 2 per token), the same on every rank; with `lora`, per-expert adapters
    with non-zero B on both projections; `skewed`: the router sends every token to experts 0 and 1 (with the
    inputs' first feature set to 1)."""
    torch.manual_seed(0)
    moe = MoE(Config.from_name("tiny-llama", **EXPERT_FAMILIES[family]))
    if lora:
        moe.experts.gate_up_lora = ExpertLoRA(moe.experts.gate_up_proj, rank=2, scaling=0.5)
        moe.experts.down_lora = ExpertLoRA(moe.experts.down_proj, rank=2, scaling=0.5)
        for adapter in (moe.experts.gate_up_lora, moe.experts.down_lora):
            torch.nn.init.normal_(adapter.lora_B.weight, std=0.1)
    if skewed:
        with torch.no_grad():
            moe.router.weight[:, 0] = torch.tensor([8.0, 6.0, -8.0, -8.0])
    return moe


def inputs(ranks: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens (ranks, TOKENS, C) and the targets the loss projects the outputs on."""
    generator = torch.Generator().manual_seed(1)
    C = Config.from_name("tiny-llama", **EXPERT_FAMILIES["qwen3-moe"]).hidden_size
    x = torch.randn(ranks, TOKENS, C, generator=generator)
    if skewed:
        x[..., 0] = 1.0
    return x, torch.randn(ranks, TOKENS, C, generator=generator)


def loss_and_gradients(
    moe: MoE, x: torch.Tensor, target: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss of tokens x (B, T, C) and the gradients of x and of every parameter (DTensors as their local rows)."""
    x = x.clone().requires_grad_(True)
    loss = (moe(x) * target).sum()
    loss.backward()
    gradients = {"x": x.grad}
    for name, param in moe.named_parameters():
        gradient = param.grad
        gradients[name] = gradient.to_local() if hasattr(gradient, "to_local") else gradient
    return loss.item(), gradients


def expert_parallel_case(family: str, skewed: bool, lora: bool) -> tuple[float, dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ranks,))
    moe = moe_layer(family, skewed, lora)
    shard_experts(moe.experts, ExpertShard(mesh.get_group(), rank, ranks), mesh)
    x, target = inputs(ranks, skewed)
    loss, gradients = loss_and_gradients(moe, x[rank : rank + 1], target[rank : rank + 1])
    dist.all_reduce(gradients["router.weight"])  # the router is replicated: its gradient is the ranks' sum
    return loss, {name: gradient.numpy() for name, gradient in gradients.items()}


def all_cases_on_this_rank() -> dict:
    return {case: expert_parallel_case(*case) for case in CASES}


@pytest.mark.parametrize("ranks", [2, 4])
def test_an_expert_group_computes_what_one_process_computes(tmp_path, ranks: int) -> None:
    """The ranks' losses add up to one process's; each rank's input gradients are one process's for its tokens,
    the router's summed over ranks are one process's, and each rank's expert weights' and adapters' gradients
    are one process's for its experts: within 1e-5, skewed routing included."""
    answers = on_ranks(ranks, all_cases_on_this_rank, tmp_path)
    for case in CASES:
        family, skewed, _ = case
        x, target = inputs(ranks, skewed)
        expected_loss, expected = loss_and_gradients(moe_layer(*case), x, target)
        assert sum(answers[rank][case][0] for rank in range(ranks)) == pytest.approx(expected_loss, abs=1e-5)
        assert set(answers[0][case][1]) == set(expected), case
        for rank in range(ranks):
            got = {name: torch.from_numpy(gradient) for name, gradient in answers[rank][case][1].items()}
            share = slice(rank * 4 // ranks, (rank + 1) * 4 // ranks)
            for name, gradient in expected.items():
                want = (
                    gradient[rank : rank + 1]
                    if name == "x"
                    else gradient
                    if name == "router.weight"
                    else gradient[share]
                )
                torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5, msg=f"{case} {rank} {name}")
        if skewed:
            assert expected["experts.gate_up_proj"][2:].abs().max() == 0  # no token for experts 2 and 3
        assert expected["experts.down_proj"].abs().max() > 1e-3  # something was compared


def test_a_rank_owns_its_share_of_the_experts() -> None:
    assert [ExpertShard(None, rank, 4).local(8) for rank in (0, 3)] == [slice(0, 2), slice(6, 8)]
