"""The LoRA recipe end to end: the same engine as full fine-tuning with a different model and a different save."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from crash_harness import run_litsft
from launch import (
    EXPERT_FAMILIES,
    TINY_MOE,
    TINY_PHI3,
    litsft,
    litsft_in_process,
    litsft_two_nodes,
    stopped_copy,
    write_records,
    write_tiny_checkpoint,
)
from safetensors.torch import load_file
from test_training_engine import finetune_args

from litsft.checkpoint.model_loader import load_model
from litsft.model.network.transformer import Transformer


def lora_args(
    checkpoint: Path,
    data: Path,
    out_dir: Path,
    micro: int,
    steps: int,
    *extra: str,
    dropout: float | None = None,
) -> list[str]:
    """finetune_lora's arguments; `dropout` None leaves --lora.dropout at its default (0.05)."""
    args = finetune_args(checkpoint, data, out_dir, micro, steps, *extra)
    dropout_args = [] if dropout is None else ["--lora.dropout", str(dropout)]
    return ["finetune_lora", *args[1:], "--lora.rank", "4", "--lora.alpha", "8", *dropout_args]


def digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# The NF4 base: every projection splits into 2 shards of whole NF4 scale blocks (64 x 256 values).
NF4_SHAPES = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
QLORA_DORA = ("--quantize", "nf4", "--lora.variant", "dora")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    write_tiny_checkpoint(root / "base", seed=1)
    write_tiny_checkpoint(root / "base-tiny-gemma2", seed=1, model="tiny-gemma2")
    write_tiny_checkpoint(root / "base-tiny-phi3", seed=1, **TINY_PHI3)
    write_tiny_checkpoint(root / "base-nf4", seed=1, **NF4_SHAPES)
    write_records(root / "data.json", count=48)
    return root


@pytest.mark.parametrize(
    "kind, steps, extra",
    [("lora", 12, ()), ("qlora-dora", 6, QLORA_DORA), ("pissa", 6, ("--lora.variant", "pissa"))],
)
def test_resume_after_a_kill_gives_identical_adapters_and_the_base_never_changes(
    workspace: Path, kind: str, steps: int, extra: tuple[str, ...]
) -> None:
    """Killed two steps after a checkpoint and relaunched: the adapters (and DoRA magnitudes, over an NF4
    base; PiSSA's initial adapters, re-derived with its residual base from the base checkpoint) are
    bit-identical to the uninterrupted run's."""
    base, data = workspace / ("base-nf4" if "qlora" in kind else "base"), workspace / "data.json"
    base_before = digest(base)
    save = steps // 2
    args = [
        "--devices",
        "2",
        "--fsdp.sharding_strategy",
        "FULL_SHARD",
        "--train.save_interval",
        str(save),
        *extra,
    ]
    uninterrupted, resumed = workspace / f"uninterrupted-{kind}", workspace / f"resumed-{kind}"
    result = litsft(lora_args(base, data, uninterrupted, 2, steps, *args), workspace)
    assert (
        "Trainable parameters:" in result.stdout and "vs" in result.stdout
    )  # adapter vs full memory, in the log
    killed = run_litsft(lora_args(base, data, resumed, 2, steps, *args), workspace, f"after_step_{save + 2}")
    assert killed.returncode != 0 and not (resumed / "final").exists()
    result = litsft(lora_args(base, data, resumed, 2, steps, *args), workspace)
    assert "Resumed from" in result.stdout + result.stderr

    a = load_file(uninterrupted / "final" / "adapter.safetensors")
    b = load_file(resumed / "final" / "adapter.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a), "adapters were trained"
    assert digest(base) == base_before  # frozen base: not a byte of it changed

    # Step checkpoints hold adapters and their optimizer state only, not the frozen base.
    shard_files = sorted((uninterrupted / f"step-{save:08d}" / "shards").glob("*.safetensors"))
    stored = [key for path in shard_files for key in load_file(path)]
    assert stored and all(".lora_" in key for key in stored)


@pytest.mark.parametrize(
    "kind, base_name, extra",
    [
        ("lora", "base", ()),
        ("lora-gemma2", "base-tiny-gemma2", ()),
        ("lora-phi3", "base-tiny-phi3", ()),
        ("loraplus", "base", ("--lora.variant", "loraplus", "--lora.loraplus_lr_ratio", "4")),
        ("pissa", "base", ("--lora.variant", "pissa")),
        ("qlora-dora", "base-nf4", QLORA_DORA),
    ],
)
def test_lora_on_two_processes_equals_one_and_exports_to_transformers(
    workspace: Path, kind: str, base_name: str, extra: tuple[str, ...], capsys: pytest.CaptureFixture
) -> None:
    """One process == two FULL_SHARD processes (== two HYBRID_SHARD nodes, for the NF4 base, whose shards
    must be the rows of the unsharded quantization), with the default LoRA dropout (0.05): each sample's
    masks do not depend on the rank it lands on. The merged export gives the trained model's logits.
    The single-process run and the export run in this process, the distributed runs as users launch them."""
    base, data = workspace / base_name, workspace / "data.json"
    single = workspace / f"single-{kind}"
    litsft_in_process(lora_args(base, data, single, 4, 4, *extra), workspace, capsys)
    assert json.loads((single / "final" / "lora_config.json").read_text())["dropout"] == 0.05
    runs = {"2 processes FULL_SHARD": workspace / f"double-{kind}"}
    litsft(lora_args(base, data, runs["2 processes FULL_SHARD"], 2, 4, "--devices", "2", *extra), workspace)
    if "qlora" in kind:
        out = runs["2 nodes x 1 device HYBRID_SHARD"] = workspace / f"two-nodes-{kind}"
        hybrid = ("--num_nodes", "2", "--fsdp.sharding_strategy", "HYBRID_SHARD", *extra)
        litsft_two_nodes(lora_args(base, data, out, 2, 4, *hybrid), workspace)
    a = load_file(single / "final" / "adapter.safetensors")
    for name, out in runs.items():
        b = load_file(out / "final" / "adapter.safetensors")
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5, name

    # Merged model = base + adapters (for QLoRA: the dequantized NF4 base); exported to HF it gives the
    # logits of the model as trained in transformers.
    model = load_model(single / "final", torch.device("cpu"), torch.float32)
    export = ["convert_to_hf", str(single / "final"), "--out_dir", str(workspace / f"hf-{kind}")]
    litsft_in_process(export, workspace, capsys)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(workspace / f"hf-{kind}").eval()
    tokens = torch.randint(0, 500, (2, 64))  # past the tiny Phi-3's LongRoPE switch
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() < 1e-4
    assert isinstance(model, Transformer)


def test_elastic_resume_with_dropout_equals_the_uninterrupted_run(
    workspace: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two FULL_SHARD processes checkpoint at step 2 of 4; relaunched on one process (micro 2 x accumulation
    2 instead of 2 ranks x micro 2) it finishes with the adapters of the uninterrupted two-process run, with
    the default dropout on: the masks of steps 3 and 4 do not depend on how many processes draw them."""
    base, data = workspace / "base", workspace / "data.json"
    uninterrupted, resumed = workspace / "elastic-uninterrupted", workspace / "elastic-resumed"
    litsft(
        lora_args(base, data, uninterrupted, 2, 4, "--devices", "2", "--train.save_interval", "2"), workspace
    )
    stopped_copy(uninterrupted, resumed, last_step=4)
    result = litsft_in_process(
        lora_args(base, data, resumed, 2, 4, "--train.save_interval", "2"), workspace, capsys
    )
    assert "Resumed from" in result.stdout + result.stderr
    a = load_file(uninterrupted / "final" / "adapter.safetensors")
    b = load_file(resumed / "final" / "adapter.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a), "adapters were trained"


def test_lora_on_a_mixture_of_experts_exports_a_peft_adapter_equal_to_the_merged_model(
    workspace: Path, capsys
) -> None:
    """all-linear on an MoE model adapts its attention: the PEFT export loads in PEFT over the exported base
    and gives the merged export's logits; the routers and experts come out as they went in."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    base, data, out = workspace / "base-tiny-moe", workspace / "data.json", workspace / "moe-lora"
    write_tiny_checkpoint(base, seed=1, **TINY_MOE)
    litsft_in_process(lora_args(base, data, out, 2, 2, dropout=0.0), workspace, capsys)
    adapted = {name.split(".")[3] for name in load_file(out / "final" / "adapter.safetensors")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for lora_format in ("peft", "merged"):
        command = ["convert_to_hf", str(out / "final"), "--out_dir", str(out / lora_format)]
        litsft_in_process([*command, "--lora_format", lora_format], workspace, capsys)
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = AutoPeftModelForCausalLM.from_pretrained(out / "peft").eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
        assert (peft_logits - merged(tokens).logits).abs().max() < 1e-5
    base_model = load_model(base, torch.device("cpu"), torch.float32)
    experts = merged.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(experts, base_model.blocks[0].mlp.experts.gate_up_proj)


def test_lora_on_qwen2_moe_adapts_its_shared_expert_and_exports_a_peft_adapter_equal_to_the_merged_model(
    workspace: Path, capsys
) -> None:
    """--lora.targets [q, gate, up, down] on tiny-qwen2-moe (layer 0 dense, layer 1 routed beside a shared
    expert) adapts the dense MLP, the shared expert's projections and every expert, and trains them; the PEFT
    export (target_modules for the projections, target_parameters for the fused experts) loads in PEFT over the
    exported base with the merged export's logits, which are the trained model's."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    base, data, out = workspace / "base-tiny-qwen2-moe", workspace / "data.json", workspace / "qwen2-moe-lora"
    write_tiny_checkpoint(base, seed=1, model="tiny-qwen2-moe")
    targets = ("--lora.targets", "[q, gate, up, down]")
    litsft_in_process(lora_args(base, data, out, 2, 2, *targets, dropout=0.0), workspace, capsys)
    adapters = load_file(out / "final" / "adapter.safetensors")
    adapted = {name.rsplit(".", 2)[0] for name in adapters}
    assert {
        "blocks.0.mlp.gate_proj",
        "blocks.1.mlp.shared_expert.gate_proj",
        "blocks.1.mlp.shared_expert.down_proj",
        "blocks.1.mlp.experts.gate_up_lora",
        "blocks.1.mlp.experts.down_lora",
    } <= adapted
    assert adapters["blocks.1.mlp.shared_expert.up_proj.lora_B.weight"].abs().sum() > 0
    for lora_format in ("peft", "merged"):
        command = ["convert_to_hf", str(out / "final"), "--out_dir", str(out / lora_format)]
        litsft_in_process([*command, "--lora_format", lora_format], workspace, capsys)
    model = load_model(out / "final", torch.device("cpu"), torch.float32)
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = AutoPeftModelForCausalLM.from_pretrained(out / "peft").eval()(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(tokens).logits
        assert (peft_logits - merged_logits).abs().max() < 1e-5
        assert (merged_logits - model(tokens)).abs().max() < 1e-4


def test_lora_on_a_mixture_of_experts_resumes_with_its_own_load_balancing_weight(
    workspace: Path, capsys
) -> None:
    """finetune_lora --train.router_aux_loss_coef, stopped after step 2 of 4 and relaunched with the same
    command: it resumes (it was refused as "written for a different model") to the uninterrupted run's
    adapters."""
    base, data = (
        write_tiny_checkpoint(workspace / "base-moe-coef", seed=1, **TINY_MOE),
        workspace / "data.json",
    )
    args = ("--train.save_interval", "2", "--train.router_aux_loss_coef", "0.1")
    uninterrupted, resumed = workspace / "moe-coef-uninterrupted", workspace / "moe-coef-resumed"
    litsft_in_process(lora_args(base, data, uninterrupted, 2, 4, *args, dropout=0.0), workspace, capsys)
    stopped_copy(uninterrupted, resumed, last_step=4)
    result = litsft_in_process(lora_args(base, data, resumed, 2, 4, *args, dropout=0.0), workspace, capsys)
    assert "Resumed from" in result.stdout + result.stderr
    a = load_file(uninterrupted / "final" / "adapter.safetensors")
    b = load_file(resumed / "final" / "adapter.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@pytest.mark.parametrize("family", EXPERT_FAMILIES)
def test_lora_on_the_experts_saves_every_experts_complete_adapter_on_two_processes(
    workspace: Path, capsys, family: str
) -> None:
    """--lora.targets experts on two FULL_SHARD processes (experts sharded along the expert dimension) saves
    every expert's complete A and B: each expert's slice in the file equals the one-process run's (the
    reference, whose weights are whole), and every expert's B was trained. The merged export gives the adapted
    model's logits in transformers, and so does the PEFT export (target_parameters on the fused experts) in PEFT."""
    from transformers import AutoModelForCausalLM

    base, data = workspace / f"base-tiny-{family}", workspace / "data.json"
    write_tiny_checkpoint(base, seed=1, **EXPERT_FAMILIES[family])
    targets = ("--lora.targets", "[q, experts]")
    single, double = workspace / f"experts-1-{family}", workspace / f"experts-2-{family}"
    litsft_in_process(lora_args(base, data, single, 4, 3, *targets, dropout=0.0), workspace, capsys)
    litsft(lora_args(base, data, double, 2, 3, "--devices", "2", *targets, dropout=0.0), workspace)
    a = load_file(single / "final" / "adapter.safetensors")
    b = load_file(double / "final" / "adapter.safetensors")
    assert a.keys() == b.keys()
    expert_names = [name for name in a if ".experts." in name]
    layers = {name.split(".")[1] for name in a}
    assert len(expert_names) == 4 * len(layers)  # gate_up and down, A and B, in every block
    for name in expert_names:
        assert a[name].shape == b[name].shape and a[name].shape[0] == TINY_MOE["num_experts"], name
        for expert in range(TINY_MOE["num_experts"]):
            assert (a[name][expert] - b[name][expert]).abs().max() < 1e-5, (name, expert)
            if name.endswith("lora_B.weight"):
                assert b[name][expert].abs().sum() > 0, (name, expert)

    model = load_model(single / "final", torch.device("cpu"), torch.float32)
    export = ["convert_to_hf", str(single / "final"), "--out_dir", str(workspace / f"experts-hf-{family}")]
    litsft_in_process(export, workspace, capsys)
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = (
            AutoModelForCausalLM.from_pretrained(workspace / f"experts-hf-{family}").eval()(tokens).logits
        )
        assert (hf_logits - model(tokens)).abs().max() < 1e-4
    from peft import AutoPeftModelForCausalLM

    litsft_in_process(
        [*export[:3], str(workspace / f"experts-peft-{family}"), "--lora_format", "peft"], workspace, capsys
    )
    with torch.no_grad():
        peft_logits = (
            AutoPeftModelForCausalLM.from_pretrained(workspace / f"experts-peft-{family}")
            .eval()(tokens)
            .logits
        )
        assert (peft_logits - hf_logits).abs().max() < 1e-5
