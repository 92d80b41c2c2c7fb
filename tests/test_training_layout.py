"""The parallel layout (litsft/training/layout.py) and what it promises end to end: context parallelism
(`--parallel.context N`) trains what one process trains, on every layout it combines with, and resumes across
layouts. The single-process references run in this process; the distributed runs as users launch them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch import (
    EXPERT_FAMILIES,
    TINY_MOE,
    litsft,
    litsft_in_process,
    litsft_two_nodes,
    max_difference,
    stopped_copy,
    write_records,
    write_tiny_checkpoint,
)
from safetensors.torch import load_file

from litsft.errors import LitsftError
from litsft.training.layout import ParallelLayout

# ---- the layout ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "shard_group", "data_replicas", "mesh"),
    [
        (ParallelLayout.of(1), 1, 1, ((1,), ("shard",))),
        (ParallelLayout.of(8, 1, "FULL_SHARD", 2), 8, 4, ((8,), ("shard",))),
        (ParallelLayout.of(8, 1, "SHARD_GRAD_OP", 4), 8, 2, ((8,), ("shard",))),
        (ParallelLayout.of(4, 2, "HYBRID_SHARD", 2), 4, 4, ((2, 4), ("replicate", "shard"))),
        (ParallelLayout.of(4, 2, "NO_SHARD", 4), 1, 2, ((8, 1), ("replicate", "shard"))),
    ],
)
def test_the_layout_says_how_ranks_divide_the_work(layout, shard_group, data_replicas, mesh) -> None:
    assert layout.shard_group_size == shard_group
    assert layout.data_replicas == data_replicas
    assert layout.fsdp_mesh_shape == mesh


def test_context_groups_are_consecutive_ranks_that_share_a_data_rank() -> None:
    layout = ParallelLayout.of(4, 2, "HYBRID_SHARD", 2)
    assert [layout.data_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.context_rank(rank) for rank in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert "context 2 x data 4" in layout.describe()


def test_layouts_that_cannot_split_are_refused_naming_the_sizes_that_would() -> None:
    with pytest.raises(LitsftError, match=r"--parallel.context=3 does not divide --devices=8.*1, 2, 4, 8$"):
        ParallelLayout.of(8, 1, "FULL_SHARD", 3)
    with pytest.raises(LitsftError, match="at least 1"):
        ParallelLayout.of(8, 1, "FULL_SHARD", 0)
    with pytest.raises(LitsftError, match=r"does not divide tiny's 6 attention heads.*pick one of 1, 2$"):
        ParallelLayout.of(8, 1, "FULL_SHARD", 4).check_heads(6, "tiny")


def test_expert_groups_are_consecutive_ranks_of_a_shard_group_and_the_rest_shard_their_weights() -> None:
    layout = ParallelLayout.of(4, 2, "FULL_SHARD", expert=4)
    assert [layout.expert_rank(rank) for rank in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert layout.expert_group(5) == [4, 5, 6, 7]
    assert layout.expert_fsdp_mesh_shape == ((2, 4), ("efsdp", "expert"))
    assert "expert 4 x expert-fsdp 2" in layout.describe()
    hybrid = ParallelLayout.of(4, 2, "HYBRID_SHARD", 2, expert=2)
    assert hybrid.expert_group(6) == [6, 7]
    assert hybrid.expert_fsdp_mesh_shape == ((2, 2, 2), ("replicate", "efsdp", "expert"))
    assert ParallelLayout.of(2, expert=2).expert_fsdp_mesh_shape == ((1, 2), ("efsdp", "expert"))


def test_expert_sizes_that_cannot_split_are_refused_naming_the_sizes_that_would() -> None:
    with pytest.raises(
        LitsftError, match=r"--parallel.expert=3 does not divide the shard group of 4 ranks.*1, 2, 4$"
    ):
        ParallelLayout.of(4, expert=3)
    with pytest.raises(
        LitsftError, match=r"shard group of 2 ranks \(--devices=2 of a node under HYBRID_SHARD"
    ):
        ParallelLayout.of(2, 2, "HYBRID_SHARD", expert=4)
    with pytest.raises(LitsftError, match="NO_SHARD shards nothing"):
        ParallelLayout.of(4, 1, "NO_SHARD", expert=2)
    with pytest.raises(LitsftError, match="at least 1"):
        ParallelLayout.of(4, expert=0)
    with pytest.raises(LitsftError, match=r"does not divide tiny's 6 experts.*pick one of 1, 2$"):
        ParallelLayout.of(4, expert=4).check_experts(6, "tiny")
    with pytest.raises(LitsftError, match="tiny has no experts"):
        ParallelLayout.of(4, expert=2).check_experts(0, "tiny")
    ParallelLayout.of(4, expert=4).check_experts(8, "tiny")


# ---- context parallelism end to end -------------------------------------------------------------------------
def finetune_args(
    recipe: str, checkpoint: Path, data: Path, out_dir: Path, micro: int, steps: int, *extra: str
) -> list[str]:
    return [
        recipe, str(checkpoint), "--out_dir", str(out_dir),
        "--data", "JSON", "--data.json_path", str(data),
        "--train.global_batch_size", "4", "--train.micro_batch_size", str(micro),
        "--train.max_steps", str(steps), "--train.max_seq_length", "64",
        "--optimizer.lr", "1e-3", "--optimizer.warmup_steps", "1",
        "--precision", "32-true", "--eval.max_new_tokens", "0", "--accelerator", "cpu", *extra,
    ]  # fmt: skip


MODELS = {
    "tiny-llama": {},
    "tiny-mistral": dict(hf_architecture="MistralForCausalLM", sliding_window=6),
    "tiny-gemma2": dict(model="tiny-gemma2"),
    "tiny-qwen3": dict(hf_architecture="Qwen3ForCausalLM", qk_norm=True),
    "tiny-moe": TINY_MOE,
}
"""tiny-llama has 4 query heads and 2 kv heads: context 4 repeats each kv head. The window (6) is shorter
than most documents (7 to 28 tokens); Gemma 2 alternates windowed and global layers and soft-caps."""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("context")
    for name, overrides in {
        **MODELS,
        "tiny-olmoe": EXPERT_FAMILIES["olmoe"],
        "tiny-mixtral": EXPERT_FAMILIES["mixtral"],
    }.items():
        write_tiny_checkpoint(root / name, seed=1, **overrides)
    write_records(root / "data.json", count=32)
    return root


def reference(workspace: Path, capsys, name: str, recipe: str = "finetune_full", *extra: str) -> Path:
    """One process, micro-batches of 4 (no accumulation), as the distributed runs are compared with."""
    out = workspace / f"{recipe}-{name}-one{'-'.join(extra)}"
    if not (out / "final").exists():
        args = finetune_args(recipe, workspace / name, workspace / "data.json", out, 4, 3, *extra)
        litsft_in_process(args, workspace, capsys)
    return out / "final"


def saved_adapters(*finals: Path) -> list[dict[str, torch.Tensor]]:
    """The adapters finetune_lora saved in each final folder, which must name the same tensors."""
    adapters = [load_file(final / "adapter.safetensors") for final in finals]
    assert all(adapter.keys() == adapters[0].keys() for adapter in adapters)
    return adapters


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(MODELS))
def test_context_2_trains_as_one_process_for_every_family(workspace: Path, name: str, capsys) -> None:
    """Packed rows over 2 context ranks, micro-batches of 2 accumulated twice, against one process."""
    expected = reference(workspace, capsys, name)
    out = workspace / f"{name}-context2"
    args = finetune_args("finetune_full", workspace / name, workspace / "data.json", out, 2, 3)
    result = litsft([*args, "--devices", "2", "--parallel.context", "2"], workspace)
    assert "context 2 x data 1" in result.stdout
    assert max_difference(expected, out / "final") < 1e-5
    assert max_difference(workspace / name, out / "final") > 1e-3  # training moved the weights


def test_context_4_unpacked_rows_and_hybrid_data_2_x_context_2_train_as_one_process(
    workspace: Path, capsys
) -> None:
    """Context 4 (more ranks than kv heads) on rows that are not packed; and 2 nodes x 2 devices of HYBRID_SHARD
    with context 2: two data replicas of two context ranks, parameters sharded in a node."""
    unpacked = reference(workspace, capsys, "tiny-llama", "finetune_full", "--data.packing", "false")
    out = workspace / "context4-unpacked"
    args = finetune_args("finetune_full", workspace / "tiny-llama", workspace / "data.json", out, 2, 3)
    litsft([*args, "--data.packing", "false", "--devices", "4", "--parallel.context", "4"], workspace)
    assert max_difference(unpacked, out / "final") < 1e-5

    hybrid = workspace / "hybrid-context2"
    args = finetune_args("finetune_full", workspace / "tiny-llama", workspace / "data.json", hybrid, 2, 3)
    litsft_two_nodes(
        [*args, "--num_nodes", "2", "--devices", "2", "--fsdp.sharding_strategy", "HYBRID_SHARD",
         "--parallel.context", "2"],
        workspace, devices_per_node=2,
    )  # fmt: skip
    assert max_difference(reference(workspace, capsys, "tiny-llama"), hybrid / "final") < 1e-5


def test_lora_with_dropout_over_context_2_trains_as_one_process(workspace: Path, capsys) -> None:
    """Each context rank draws, for its slice of a row, the dropout masks one process draws for the row: rows
    not packed, each then a document of its padded width in the row the context ranks split."""
    lora = ("--lora.dropout", "0.1", "--data.packing", "false")
    expected = reference(workspace, capsys, "tiny-llama", "finetune_lora", *lora)
    out = workspace / "lora-context2"
    args = finetune_args("finetune_lora", workspace / "tiny-llama", workspace / "data.json", out, 2, 3, *lora)
    litsft([*args, "--devices", "2", "--parallel.context", "2"], workspace)
    a, b = saved_adapters(expected, out / "final")
    assert largest_difference(a, b) < 1e-5
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a), "adapters were trained"


def test_a_run_stopped_under_context_2_resumes_under_context_1_and_back(workspace: Path, capsys) -> None:
    """Stopped after step 2 of 4 and resumed with another layout (DCP checkpoints reshard; the data order does
    not depend on the layout): the same weights as the uninterrupted run."""
    base, data = workspace / "tiny-llama", workspace / "data.json"
    context2 = ("--devices", "2", "--parallel.context", "2")
    runs = {}
    for name, first, then in (("2-then-1", context2, ()), ("1-then-2", (), context2)):
        whole = workspace / f"resume-{name}-whole"
        args = finetune_args("finetune_full", base, data, whole, 2, 4, "--train.save_interval", "2")
        litsft([*args, *first], workspace)
        resumed = stopped_copy(whole, workspace / f"resume-{name}", last_step=4)
        args = finetune_args("finetune_full", base, data, resumed, 2, 4, "--train.save_interval", "2")
        result = litsft([*args, *then], workspace)
        assert "Resumed from" in result.stdout + result.stderr
        runs[name] = max_difference(whole / "final", resumed / "final")
    assert all(difference < 1e-5 for difference in runs.values()), runs


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--devices", "2", "--parallel.context", "3"), "--parallel.context=3 does not divide --devices=2"),
        (("--devices", "4", "--parallel.context", "4"), None),
    ],
)
def test_a_context_size_that_cannot_split_is_refused_before_anything_starts(
    workspace: Path, capsys, extra: tuple[str, ...], message: str | None
) -> None:
    """One line, a non-zero exit, nothing written. tiny-gemma2's 4 heads take context 4; a model of 6 heads
    would not (the layout's own test)."""
    out = workspace / "refused"
    args = finetune_args(
        "finetune_full", workspace / "tiny-llama", workspace / "data.json", out, 2, 1, *extra
    )
    if message is None:
        args = [a if a != str(workspace / "tiny-llama") else str(workspace / "tiny-heads-6") for a in args]
        write_tiny_checkpoint(workspace / "tiny-heads-6", seed=1, num_heads=6, num_kv_heads=2, head_dim=16)
        message = "--parallel.context=4 does not divide tiny-llama's 6 attention heads"
    result = litsft_in_process(args, workspace, capsys, check=False)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


# ---- expert parallelism end to end --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "devices", "extra"),
    [
        ("tiny-moe", "2", ("--parallel.expert", "2")),
        ("tiny-moe", "4", ("--parallel.expert", "4")),
        ("tiny-moe", "4", ("--parallel.expert", "2")),  # FSDP 2 x expert 2
        ("tiny-moe", "2", ("--parallel.expert", "2", "--parallel.context", "2")),
        ("tiny-olmoe", "2", ("--parallel.expert", "2")),
        ("tiny-mixtral", "2", ("--parallel.expert", "2")),
    ],
)
def test_expert_parallel_trains_as_one_process(
    workspace: Path, capsys, model: str, devices: str, extra: tuple
) -> None:
    """A tiny MoE's 4 experts (Qwen3-MoE, OLMoE, Mixtral) split over expert groups, micro-batches of 1
    (accumulated where the ranks are fewer than the rows), against one process: the same final weights, experts
    included."""
    expected = reference(workspace, capsys, model)
    out = workspace / f"expert-{model}-{devices}-{'-'.join(extra)}"
    micro = "2" if "--parallel.context" in extra else "1"
    args = finetune_args("finetune_full", workspace / model, workspace / "data.json", out, micro, 3)
    result = litsft([*args, "--devices", devices, *extra], workspace)
    assert f"expert {extra[1]} x expert-fsdp {int(devices) // int(extra[1])}" in result.stdout
    assert max_difference(expected, out / "final") < 1e-5
    assert max_difference(workspace / model, out / "final") > 1e-3  # training moved the weights


def test_lora_on_experts_split_over_an_expert_group_saves_every_expert_complete(
    workspace: Path, capsys
) -> None:
    """Per-expert adapters sharded with their experts over 2 ranks: the saved adapter holds all 4 experts' A and B,
    equal to one process's."""
    lora = ("--lora.targets", "[q, experts]", "--lora.dropout", "0")
    expected = reference(workspace, capsys, "tiny-moe", "finetune_lora", *lora)
    out = workspace / "lora-expert2"
    args = finetune_args("finetune_lora", workspace / "tiny-moe", workspace / "data.json", out, 1, 3, *lora)
    litsft([*args, "--devices", "2", "--parallel.expert", "2"], workspace)
    a, b = saved_adapters(expected, out / "final")
    experts = [k for k in a if "experts" in k]
    assert experts and all(b[k].shape[0] == 4 for k in experts)
    assert largest_difference(a, b) < 1e-5
    assert any(k.endswith("lora_B.weight") and "experts" in k and a[k].abs().sum() > 0 for k in a)


def test_a_run_stopped_under_expert_2_then_expert_1_ends_under_expert_4_as_if_never_stopped(
    workspace: Path, capsys
) -> None:
    """Six steps at expert 2 on 2 ranks, saved every 2, against the same run stopped after step 2, resumed at
    expert 1 (plain FSDP on 2 ranks), stopped again after step 4 (its own checkpoint) and finished at expert 4 on
    4 ranks: DCP reshards the experts' weights and optimizer state at each change, and it ends where the
    uninterrupted run does."""
    base, data = workspace / "tiny-moe", workspace / "data.json"

    def run(out: Path, *layout: str) -> str:
        args = finetune_args("finetune_full", base, data, out, 1, 6, "--train.save_interval", "2")
        result = litsft([*args, *layout], workspace)
        return result.stdout + result.stderr

    whole = workspace / "expert-resume-whole"
    run(whole, "--devices", "2", "--parallel.expert", "2")
    first = stopped_copy(whole, workspace / "expert-resume-1", last_step=6)
    shutil.rmtree(first / "step-00000004")  # stopped after step 2
    assert "step-00000002 at step 2" in run(first, "--devices", "2")
    second = stopped_copy(
        first, workspace / "expert-resume-4", last_step=6
    )  # stopped after expert 1's step 4
    assert "step-00000004 at step 4" in run(second, "--devices", "4", "--parallel.expert", "4")
    assert max_difference(whole / "final", second / "final") < 1e-5
