"""The mixture-of-experts MLP against independent references: a per-token loop over each token's experts,
transformers' routers, transformers' load-balancing loss, and transformers' gradients with that loss on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from launch import TINY_MOE
from tiny_hf import MOE_KINDS, save_tiny_hf, tiny_hf_model

from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.huggingface.convert import convert_from_hf
from litsft.model.config import Config
from litsft.model.families import family_of
from litsft.model.network.moe import GroupedExperts, load_balancing_loss, route, slice_sizes
from litsft.model.network.transformer import Transformer

torch.set_num_threads(1)
E, C, I = 4, 16, 24  # noqa: E741


def _experts(seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    return GroupedExperts(E, C, I)


def _per_token_reference(experts: GroupedExperts, x, chosen, weights) -> torch.Tensor:
    """The definition, one token and one of its experts at a time."""
    rows = []
    for token in range(x.shape[0]):
        total = torch.zeros(C)
        for expert, weight in zip(chosen[token].tolist(), weights[token]):
            gate, up = (experts.gate_up_proj[expert] @ x[token]).chunk(2)
            total = total + weight * (experts.down_proj[expert] @ (F.silu(gate) * up))
        rows.append(total)
    return torch.stack(rows)


def test_experts_equal_a_per_token_loop_with_an_expert_that_gets_no_token():
    """Output and every gradient equal the per-token definition; expert 3, routed nothing, still gets a
    gradient (zero) in the one fused parameter, so no rank can skip a reduction for it."""
    experts = _experts()
    x = torch.randn(7, C, requires_grad=True)
    chosen = torch.randint(0, 3, (7, 2))  # experts 0-2 only
    chosen[:, 1] = (chosen[:, 0] + 1) % 3
    weights = torch.rand(7, 2, requires_grad=True)
    counts = torch.bincount(chosen.flatten(), minlength=E)
    out = experts(x, chosen, weights, counts)
    reference = _per_token_reference(experts, x, chosen, weights)
    assert (out - reference).abs().max() < 1e-5
    grads = torch.autograd.grad(out.square().sum(), (x, weights, experts.gate_up_proj, experts.down_proj))
    expected = torch.autograd.grad(
        reference.square().sum(), (x, weights, experts.gate_up_proj, experts.down_proj)
    )
    for grad, want in zip(grads, expected):
        assert (grad - want).abs().max() < 1e-4
    assert torch.equal(grads[2][3], torch.zeros(2 * I, C)) and grads[2][:3].abs().sum() > 0


def test_the_grouped_mm_path_equals_the_per_expert_path():
    """The CUDA path's logic (sorted rows, offsets, transposed weights) run by torch._grouped_mm's CPU kernel:
    the same rows as one matmul per expert."""
    experts = _experts()
    sorted_x = torch.randn(11, C)
    counts = torch.tensor([3, 0, 6, 2])
    assert torch.allclose(
        experts._grouped(sorted_x, counts), experts._per_expert(sorted_x, counts), atol=1e-5
    )


def test_the_grouped_mm_path_equals_the_per_expert_path_with_gpt_oss_biases_and_clamped_swiglu():
    """gpt-oss's experts (biases on both projections, the clamped SwiGLU, a clamp random rows reach) give the
    same rows on both paths: each sorted assignment takes its own expert's biases."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, C, 8, bias=True, activation="clamped_swiglu", alpha=1.5, limit=0.5)
    with torch.no_grad():
        for bias in (experts.gate_up_proj_bias, experts.down_proj_bias):
            bias.normal_()
    sorted_x = torch.randn(11, C)
    counts = torch.tensor([3, 0, 6, 2])
    per_expert = experts._per_expert(sorted_x, counts)
    assert torch.allclose(experts._grouped(sorted_x, counts), per_expert, atol=1e-5)
    experts.limit = 100.0
    assert not torch.allclose(experts._per_expert(sorted_x, counts), per_expert, atol=1e-3)


def test_clamped_swiglu_and_the_top_k_router_equal_transformers():
    """gpt-oss's activation (transformers' GptOssExperts._apply_gate on interleaved gate/up) and its router's
    weights (GptOssTopKRouter: the top k logits, a softmax over them) with values past the clamp."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from litsft.model.network.moe import clamped_swiglu

    gate, up = 6 * torch.randn(5, 8), 6 * torch.randn(5, 8)
    interleaved = torch.stack((gate, up), dim=-1).flatten(-2)  # gate_up[..., ::2] is the gate
    hf = SimpleNamespace(alpha=1.702, limit=7.0)
    assert torch.equal(clamped_swiglu(gate, up, 1.702, 7.0), GptOssExperts._apply_gate(hf, interleaved))
    logits = torch.randn(7, 4)
    weights, chosen, probabilities = route(logits, 2, normalize=False, over_top_k=True)
    top, expected_chosen = torch.topk(logits, 2, dim=-1)
    assert torch.equal(chosen, expected_chosen)
    assert torch.allclose(weights, torch.softmax(top, dim=1), atol=1e-7, rtol=0)
    assert torch.equal(probabilities, torch.softmax(logits, dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="torch._grouped_mm's CUDA kernel needs an SM80+ GPU",
)
def test_on_a_gpu_the_experts_run_grouped_mm_and_equal_the_per_token_loop():
    """bf16 autocast on CUDA, as training runs: the experts take torch._grouped_mm (`uses_grouped_mm`), and their
    output and gradients equal the fp32 per-token definition within bf16 rounding."""
    from litsft.model.network.moe import uses_grouped_mm

    experts = _experts().cuda()
    x = torch.randn(9, C, device="cuda", requires_grad=True)
    chosen = torch.randint(0, E - 1, (9, 2), device="cuda")
    chosen[:, 1] = (chosen[:, 0] + 1) % (E - 1)  # the last expert gets no token
    weights = torch.rand(9, 2, device="cuda")
    counts = torch.bincount(chosen.flatten(), minlength=E)
    with torch.autocast("cuda", torch.bfloat16):
        assert uses_grouped_mm(x, experts)
        out = experts(x, chosen, weights, counts).float()
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    on_cpu = _experts()  # the same seed: the same weights, on the CPU
    reference = _per_token_reference(on_cpu, x.detach().cpu(), chosen.cpu(), weights.cpu())
    torch.testing.assert_close(out.detach().cpu(), reference.detach(), atol=3e-2, rtol=3e-2)


def test_tensors_without_data_split_the_assignments_evenly():
    assert slice_sizes(torch.tensor([5, 0, 1, 4]), 10) == [5, 0, 1, 4]
    assert slice_sizes(torch.empty(4, device="meta"), 10) == [3, 3, 2, 2]


@pytest.mark.parametrize("normalize", [False, True])
def test_router_equals_transformers(normalize):
    """Softmax then top-k, renormalized or not: OLMoE's and Qwen3-MoE's router (norm_topk_prob), and Mixtral's,
    which always renormalizes."""
    from transformers import MixtralConfig, OlmoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

    hidden = torch.randn(9, C)
    if normalize:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=C, num_local_experts=E, num_experts_per_tok=2))
    else:
        router = OlmoeTopKRouter(OlmoeConfig(hidden_size=C, num_experts=E, num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight)
    logits, expected_weights, expected_experts = router(hidden)
    weights, chosen, probabilities = route(hidden @ router.weight.T, 2, normalize)
    assert torch.equal(chosen, expected_experts)
    assert torch.allclose(weights, expected_weights.float(), atol=1e-7)
    assert torch.allclose(probabilities, logits.softmax(-1), atol=1e-7)


def test_a_balancing_bias_changes_which_experts_are_chosen_not_their_weights():
    """DeepSeek-V3's bias is added to the probabilities for the top-k choice only: expert 2 (probability
    0.09, bias 1) is chosen before expert 1 (0.24), and the weights stay the probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    weights, chosen, probabilities = route(logits, 2, False, bias)
    assert chosen.tolist() == [[2, 0]]
    assert torch.equal(weights, probabilities[:, [2, 0]])
    normalized, _, _ = route(logits, 2, True, bias)
    assert torch.allclose(normalized, weights / weights.sum(), atol=1e-7)


def test_the_balancing_bias_moves_each_layers_experts_towards_the_mean_load():
    from litsft.model.network.moe import update_balancing_bias

    model = Transformer(Config.from_name("tiny-llama", **TINY_MOE, router_bias_update_rate=0.1))
    update_balancing_bias(model, torch.tensor([[5.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), 0.1)
    biases = [block.mlp.balancing_bias for block in model.blocks]
    assert torch.allclose(biases[0], torch.tensor([-0.1, 0.1, 0.1, 0.1])) and torch.equal(
        biases[1], torch.zeros(4)
    )
    assert "blocks.0.mlp.balancing_bias" in model.state_dict()  # saved with the weights
    assert (
        "blocks.0.mlp.balancing_bias"
        not in Transformer(Config.from_name("tiny-llama", **TINY_MOE)).state_dict()
    )


def _converted(kind: str, tmp_path) -> tuple[torch.nn.Module, Transformer]:
    hf_model = tiny_hf_model(kind)
    convert_from_hf(save_tiny_hf(hf_model, tmp_path / "hf"), tmp_path / "litsft")
    model = Transformer(Config.from_checkpoint(tmp_path / "litsft"))
    model.load_state_dict(load_model_state_dict(tmp_path / "litsft"))
    return hf_model, model


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_training_loss_has_transformers_gradients_with_the_balancing_loss_on(tmp_path, kind):
    """One micro-batch: litsft's summed loss over its N loss tokens has the gradients of transformers' loss with
    `output_router_logits=True` (mean cross-entropy + router_aux_loss_coef x its load-balancing loss), for every
    parameter; the value returned stays the summed cross-entropy; the balancing loss of the recorded routing is
    transformers' aux_loss."""
    hf_model, model = _converted(kind, tmp_path)
    coef = 0.5  # far above the families' own, so that a missing or misweighted term shows
    hf_model.router_aux_loss_coef = model.config.router_aux_loss_coef = coef  # transformers reads it at init
    hf_model.config.output_router_logits = True
    hf_model.train()
    model.train()
    # One sequence: transformers pools the batch, litsft each sequence; for one sequence they are the same.
    tokens = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([tokens[:, 1:], torch.full((1, 1), -100)], dim=1)  # litsft's labels come shifted
    out = hf_model(tokens, labels=tokens)
    out.loss.backward()
    loss = model(tokens, labels=labels)
    (loss / (labels != -100).sum()).backward()

    routings = [mlp.routing for mlp in model.routed_mlps]
    assert abs(load_balancing_loss(routings, model.config.num_experts).item() - out.aux_loss.item()) < 1e-6
    assert abs(loss.item() / 39 - (out.loss - coef * out.aux_loss).item()) < 1e-5  # the cross-entropy alone
    hf_grads = {name: p.grad for name, p in hf_model.named_parameters()}
    weights = family_of(model.config.hf_architecture).weights
    for name, param in model.named_parameters():
        hf_name = name.replace("blocks.", "model.layers.").replace("attn.", "self_attn.")
        if hf_name not in hf_grads:  # gpt-oss keeps the name `router`
            hf_name = hf_name.replace(".router.", ".gate.")
        hf_name = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(
            name, hf_name
        )
        hf_name = hf_name.replace("attn_norm", "input_layernorm").replace(
            "mlp_norm", "post_attention_layernorm"
        )
        layout = weights.layout(name)  # gpt-oss's experts: transformers' layout, turned into litsft's
        hf_grad = layout.to_litsft(hf_grads[hf_name]) if layout is not None else hf_grads[hf_name]
        assert (param.grad - hf_grad).abs().max() < 1e-5 * max(1.0, hf_grad.abs().max()), name


def test_each_packed_document_is_balanced_on_its_own_whatever_it_is_packed_with(tmp_path):
    """Two documents packed in one row give the gradient and the logged balancing loss of the two run alone,
    summed: how sequences are grouped into micro-batches (and ranks) does not change the objective."""
    _, model = _converted("mixtral", tmp_path)
    model.config.router_aux_loss_coef = 0.5
    model.train()
    documents = [torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 20)]

    def router_grad_and_logged(*rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        model.zero_grad()
        tokens = torch.cat(rows, dim=1)
        document_ids = torch.cat([torch.full(row.shape, i) for i, row in enumerate(rows)], dim=1)
        model(tokens, document_ids=document_ids, labels=tokens).backward()
        return model.blocks[1].mlp.router.weight.grad.clone(), model.balancing_loss_sum.item()

    packed, packed_logged = router_grad_and_logged(*documents)
    (first, first_logged), (second, second_logged) = (router_grad_and_logged(d) for d in documents)
    assert (packed - (first + second)).abs().max() < 1e-5
    assert abs(packed_logged - (first_logged + second_logged)) < 1e-4
    assert first_logged != second_logged


def test_balancing_loss_is_off_in_evaluation_and_at_coefficient_zero(tmp_path):
    """Evaluation and a zero coefficient leave the routers' gradient to the cross-entropy alone."""
    _, model = _converted("olmoe", tmp_path)
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))

    def router_grad(coef: float, training: bool) -> torch.Tensor:
        model.zero_grad()
        model.config.router_aux_loss_coef = coef
        model.train(training)
        model(tokens, labels=tokens).backward()
        return model.blocks[0].mlp.router.weight.grad.clone()

    plain = router_grad(0.0, True)
    assert torch.equal(router_grad(0.3, False), plain)
    assert (router_grad(0.3, True) - plain).abs().max() > 1e-4


# ---- LoRA on the experts ---------------------------------------------------------------------------------
def _adapted_experts(seed: int = 0):
    from litsft.model.lora.layers import ExpertLoRA

    experts = _experts(seed)
    experts.gate_up_lora = ExpertLoRA(experts.gate_up_proj, 4, 2.0)
    experts.down_lora = ExpertLoRA(experts.down_proj, 4, 2.0)
    for adapter in (experts.gate_up_lora, experts.down_lora):
        torch.nn.init.normal_(adapter.lora_B.weight, std=0.1)  # a trained adapter, not a fresh (zero) one
    return experts


def test_expert_lora_equals_the_per_token_loop_over_merged_weights_on_both_paths():
    """(x A_e) B_e through the sorted slices equals the definition with W_e + s B_e A_e merged in, and so does
    the grouped_mm path; A's and B's gradients equal the merged reference's, expert 3 (routed nothing) zero."""
    experts = _adapted_experts()
    merged = _experts()
    with torch.no_grad():
        merged.gate_up_proj += experts.gate_up_lora.delta_weight()
        merged.down_proj += experts.down_lora.delta_weight()
    x = torch.randn(9, C)
    chosen = torch.randint(0, 3, (9, 2))
    chosen[:, 1] = (chosen[:, 0] + 1) % 3
    weights = torch.rand(9, 2)
    counts = torch.bincount(chosen.flatten(), minlength=E)
    reference = _per_token_reference(merged, x, chosen, weights)
    out = experts(x, chosen, weights, counts)
    assert (out - reference).abs().max() < 1e-5
    order = chosen.flatten().argsort(stable=True)
    grouped = experts._grouped(x[order // 2], counts) * weights.flatten()[order, None]
    grouped = torch.zeros_like(x).index_add_(0, order // 2, grouped)
    assert (grouped - reference).abs().max() < 1e-5
    adapters = [experts.gate_up_lora.lora_A.weight, experts.gate_up_lora.lora_B.weight]
    adapters += [experts.down_lora.lora_A.weight, experts.down_lora.lora_B.weight]
    grads = torch.autograd.grad(out.square().sum(), adapters)
    # The reference's gradients: the per-token definition over the merged weights, as functions of A and B.
    leaves = [a.detach().clone().requires_grad_() for a in adapters]
    with torch.enable_grad():
        g_up = _experts().gate_up_proj.detach() + 2.0 * leaves[1] @ leaves[0]
        down = _experts().down_proj.detach() + 2.0 * leaves[3] @ leaves[2]
        rows = []
        for token in range(9):
            total = torch.zeros(C)
            for expert, weight in zip(chosen[token].tolist(), weights[token]):
                gate, up = (g_up[expert] @ x[token]).chunk(2)
                total = total + weight * (down[expert] @ (F.silu(gate) * up))
            rows.append(total)
        expected = torch.autograd.grad(torch.stack(rows).square().sum(), leaves)
    for grad, want in zip(grads, expected):
        assert (grad - want).abs().max() < 1e-4
        assert torch.equal(grad[3], torch.zeros_like(grad[3]))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_expert_lora_model_merges_into_the_unmerged_models_logits(kind, tmp_path):
    """apply_lora with target 'experts' on each family: fresh adapters change nothing, and after training the
    merged base tensors (iter_merged_tensors, what the merged export writes) give the adapted model's logits."""
    from litsft.model.lora.config import LoRAConfig
    from litsft.model.lora.layers import apply_lora, iter_merged_tensors, lora_state_dict

    _, base = _converted(kind, tmp_path)
    config = base.config
    base_state = {name: t.clone() for name, t in base.state_dict().items()}
    lora = LoRAConfig(rank=4, alpha=8, dropout=0.0, targets=["q", "v", "experts"])
    model = apply_lora(Transformer(config), lora)
    model.load_state_dict(base_state, strict=False)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    assert torch.equal(model(tokens), base(tokens))
    adapters = lora_state_dict(model)
    E = config.num_experts
    assert adapters["blocks.0.mlp.experts.gate_up_lora.lora_A.weight"].shape == (E, 4, config.hidden_size)
    assert adapters["blocks.0.mlp.experts.down_lora.lora_B.weight"].shape == (E, config.hidden_size, 4)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("lora_B.weight"):
                tensor.normal_(std=0.05)
    merged = Transformer(config)
    merged.load_state_dict(dict(iter_merged_tensors(base_state.items(), lora_state_dict(model), lora)))
    with torch.no_grad():
        assert (model(tokens) - merged(tokens)).abs().max() < 1e-5


def _unpacked(rows: list[torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Rows as the collate makes them unpacked: right-padded to the longest, positions continued, labels
    shifted and -100 on the padding, their `row_lengths`."""
    width = max(row.numel() for row in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    for b, row in enumerate(rows):
        input_ids[b, : row.numel()] = row
        labels[b, : row.numel() - 1] = row[1:]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.arange(width).expand(len(rows), width),
        "row_lengths": torch.tensor([row.numel() for row in rows]),
    }


def _routers(model: torch.nn.Module) -> list[torch.Tensor]:
    return [module.weight for name, module in model.named_modules() if name.endswith((".router", ".gate"))]


def test_padding_is_left_out_of_the_balancing_loss_as_transformers_attention_mask_does(tmp_path):
    """Unpacked rows right-padded to the longest: each row's balancing loss and its gradient on the routers
    equal transformers' on that padded row with its attention_mask (load_balancing_loss_func weighs by it),
    and the row's alone without padding; the expert load counts k assignments per real token only."""
    from litsft.model.network.batch import model_inputs
    from litsft.model.network.moe import expert_load

    hf_model, model = _converted("qwen3-moe", tmp_path)
    hf_model.config.output_router_logits = True
    model.train()
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 512, (n,), generator=generator) for n in (9, 14)]
    batch = _unpacked(rows)
    model(**model_inputs(batch))
    k, E = model.config.experts_per_token, model.config.num_experts
    assert torch.equal(expert_load(model).sum(-1), torch.full((model.config.num_layers,), 23.0 * k))
    balancing = load_balancing_loss([block.mlp.routing for block in model.blocks], E)  # (2,)
    grads = torch.autograd.grad(balancing.sum(), _routers(model))

    hf_losses = []
    for b in range(2):  # each padded row with its mask: transformers pools the batch, litsft each row
        mask = (torch.arange(14) < batch["row_lengths"][b]).long()[None]
        hf_losses.append(hf_model(batch["input_ids"][b : b + 1], attention_mask=mask).aux_loss)
    assert (balancing - torch.stack(hf_losses).detach()).abs().max() < 1e-6
    hf_grads = torch.autograd.grad(sum(hf_losses), _routers(hf_model))
    assert all((grad - want).abs().max() < 1e-6 for grad, want in zip(grads, hf_grads))

    alone = []
    for row in rows:
        model(**model_inputs(_unpacked([row])))
        alone.append(load_balancing_loss([block.mlp.routing for block in model.blocks], E)[0])
    assert (balancing - torch.stack(alone).detach()).abs().max() < 1e-6
    alone_grads = torch.autograd.grad(sum(alone), _routers(model))
    assert all((grad - want).abs().max() < 1e-6 for grad, want in zip(grads, alone_grads))


def test_padding_is_left_out_in_the_layout_of_context_parallelism(tmp_path):
    """split_for_context turns padded rows into documents of the padded width, plus a padding document up to
    a multiple of the ranks: run as that one row (every rank's slice, joined), each row's balancing loss and
    its router gradient are the unpacked batch's, the padding document's is 0, and no padding is counted."""
    from litsft.model.network.batch import model_inputs, split_for_context
    from litsft.model.network.context_parallel import ContextShard
    from litsft.model.network.moe import expert_load

    _, model = _converted("mixtral", tmp_path)
    model.train()
    generator = torch.Generator().manual_seed(1)
    batch = _unpacked([torch.randint(1, 512, (n,), generator=generator) for n in (9, 14, 5)])
    E = model.config.num_experts

    def balancing_and_grads(inputs: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        model(**inputs)
        balancing = load_balancing_loss([block.mlp.routing for block in model.blocks], E)
        return balancing, torch.autograd.grad(balancing.sum(), _routers(model))

    unpacked, unpacked_grads = balancing_and_grads(model_inputs(batch))
    shards = [split_for_context(model_inputs(batch), ContextShard(None, r, 4)) for r in range(4)]
    assert shards[0]["real_lengths"].tolist() == [9, 14, 5, 0]  # 42 tokens padded to 44
    joined = {name: shards[0][name] for name in ("position_ids", "documents", "real_lengths")}
    joined["input_ids"] = torch.cat([shard["input_ids"] for shard in shards], dim=1)
    joined["labels"] = torch.cat([shard["labels"] for shard in shards], dim=1)
    split, split_grads = balancing_and_grads(joined)
    assert split.shape == (4,) and split[3] == 0
    assert (split[:3] - unpacked).abs().max() < 1e-6
    assert all((grad - want).abs().max() < 1e-6 for grad, want in zip(split_grads, unpacked_grads))
    assert torch.equal(
        expert_load(model).sum(-1),
        torch.full((model.config.num_layers,), 28.0 * model.config.experts_per_token),
    )
