"""litsft/model/network/sample_dropout.py: LoRA's dropout masks drawn per sample, the same for every split of a global
batch into ranks, micro-batches and accumulation steps; ordinary dropout outside a training step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_data_loader import random_samples

from litsft.data.loader import SFTLoader
from litsft.model.config import Config
from litsft.model.lora.config import ALL_LINEAR
from litsft.model.lora.layers import LoRAConfig, apply_lora
from litsft.model.network import transformer as network
from litsft.model.network.sample_dropout import (
    DropoutSamples,
    SampleDropout,
    dropout_samples,
    samples_in_micro_batch,
)
from litsft.model.network.transformer import Transformer
from litsft.training.step import dropout_samples_of, row_lengths, to_device

WIDTH = 48
P = 0.3


def test_outside_a_training_step_it_is_ordinary_dropout():
    dropout = SampleDropout(0.05).train()
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


class TwoAdapters(torch.nn.Module):
    """Two adapters' dropouts on the same input: their masks must differ."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = SampleDropout(P), SampleDropout(P)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(x), self.second(x)


def masks_of_one_step(
    packing: bool, world_size: int, micro: int, step: int = 1
) -> dict[tuple[int, ...], torch.Tensor]:
    """Each sample's (rows of sample indices') masks in the first global batch, as `world_size` ranks with
    micro-batches of `micro` rows see them, keyed by the samples the row holds."""
    samples = random_samples([5, 9, 30, 31, 6, 8, 29, 7, 12, 3, 17, 22], seed=2)
    model = TwoAdapters().train()
    masks = {}
    for rank in range(world_size):
        loader = SFTLoader(samples, 40, packing, 0, rank, world_size, micro, 4, seed=5)
        rows = loader.micro_batches()
        accumulation = loader.micro_batches_per_global_batch
        batches = [batch for _, batch in zip(range(accumulation), iter(loader))]
        inputs = [to_device(batch, torch.device("cpu")) for batch in batches]
        keyed = dropout_samples_of(batches, inputs, rank, seed=11, step=step)
        for k, (batch, model_input, where) in enumerate(zip(batches, inputs, keyed)):
            x = torch.ones(*model_input["input_ids"].shape, WIDTH)
            with dropout_samples(model, where):
                first, second = (mask.reshape(-1, WIDTH) for mask in model(x))
            for row, (start, length) in enumerate(zip(where.starts, where.lengths)):
                assert length == row_lengths(batch)[row]
                masks[tuple(rows[k][row])] = torch.stack(
                    [first[start : start + length], second[start : start + length]]
                )
    return masks


@pytest.mark.parametrize("packing", [True, False])
def test_every_split_of_a_global_batch_gives_each_sample_the_same_masks(packing):
    """1 rank x micro 4, 1 x micro 2 x accumulation 2, 2 ranks x micro 2, 2 x micro 1 x 2, 4 x micro 1: each
    sample (a packed row, or one padded sample) has the same masks in both adapters."""
    reference = masks_of_one_step(packing, 1, 4)
    assert len(reference) == 4
    for world_size, micro in ((1, 2), (2, 2), (2, 1), (4, 1)):
        masks = masks_of_one_step(packing, world_size, micro)
        assert masks.keys() == reference.keys()
        assert all(torch.equal(masks[key], reference[key]) for key in reference), (world_size, micro)
    every = torch.cat([m.flatten() for m in reference.values()])
    assert abs((every == 0).float().mean().item() - P) < 0.03
    assert torch.allclose(every[every != 0], torch.tensor(1 / (1 - P)))
    for mask in reference.values():
        assert not torch.equal(mask[0], mask[1])  # each adapter its own masks
    first, second = [m[0, : min(len(m[0]) for m in reference.values())] for m in list(reference.values())[:2]]
    assert not torch.equal(first, second)  # each sample its own masks
    next_step = masks_of_one_step(packing, 1, 4, step=2)
    assert not any(torch.equal(next_step[key], reference[key]) for key in reference if key in next_step)


def test_padding_keeps_its_values_and_each_row_starts_where_the_layout_says():
    joined = samples_in_micro_batch([3, 5], row_width=8, joined=True, first_position=2, seed=1, step=1)
    padded = samples_in_micro_batch([3, 5], row_width=8, joined=False, first_position=2, seed=1, step=1)
    assert (joined.starts, joined.tokens, padded.starts, padded.tokens) == ((0, 3), 8, (0, 8), 16)
    assert joined.keys == padded.keys and len(set(joined.keys)) == 2
    model = TwoAdapters().train()
    with dropout_samples(model, padded):
        mask = model.first(torch.ones(2, 8, WIDTH))
    assert torch.equal(mask[0, 3:], torch.ones(5, WIDTH)) and not torch.equal(
        mask[0, :3], torch.ones(3, WIDTH)
    )
    with dropout_samples(model, joined):
        joined_mask = model.first(torch.ones(1, 8, WIDTH))
    assert torch.equal(joined_mask[0, :3], mask[0, :3]) and torch.equal(joined_mask[0, 3:], mask[1, :5])


def lora_model_with_head_adapter() -> Transformer:
    torch.manual_seed(0)
    model = apply_lora(
        Transformer(Config.from_name("tiny-llama")),
        LoRAConfig(rank=4, dropout=0.2, targets=[*ALL_LINEAR, "lm_head"]),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model.train()


def loss_and_grads(model: Transformer, batch: dict[str, torch.Tensor], where: DropoutSamples):
    model.zero_grad()
    with dropout_samples(model, where):
        loss = model(**batch)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_head_adapter_draws_each_token_s_mask_from_its_sample_in_chunks_too(monkeypatch):
    """LoRA on lm_head sees only the tokens that carry a loss, a chunk at a time, each chunk recomputed in the
    backward pass: the loss and gradients are those of one chunk, so each row got its own token's mask."""
    model = lora_model_with_head_adapter()
    samples = random_samples([20, 33, 12], seed=4)
    loader = SFTLoader(samples, 40, True, 0, 0, 1, 2, 2, seed=0)
    batch = next(iter(loader))
    model_input = to_device(batch, torch.device("cpu"))
    assert model_input["loss_positions"].numel() < model_input["labels"].numel()
    where = dropout_samples_of([batch], [model_input], 0, seed=3, step=1)[0]
    one_chunk = loss_and_grads(model, model_input, where)
    monkeypatch.setattr(network, "loss_chunk_tokens", lambda *args, **kwargs: 7)
    chunked = loss_and_grads(model, model_input, where)
    torch.testing.assert_close(chunked[0], one_chunk[0], rtol=1e-5, atol=1e-5)
    for name, grad in one_chunk[1].items():
        torch.testing.assert_close(chunked[1][name], grad, rtol=1e-4, atol=1e-6)
    # The masks matter: another step's masks give another loss.
    other = dropout_samples_of([batch], [model_input], 0, seed=3, step=2)[0]
    assert abs(loss_and_grads(model, model_input, other)[0] - one_chunk[0]) > 1e-4
    assert np.isfinite(one_chunk[0].item())


def test_activation_checkpointing_recomputes_the_same_masks():
    """Checkpointed blocks run their forward again in the backward pass: the adapters' masks there are the
    ones the forward drew, so the gradients equal those of the model without checkpointing."""
    import copy

    from litsft.training.args import FSDPConfig
    from litsft.training.parallel import parallelize

    model = lora_model_with_head_adapter()
    checkpointed = copy.deepcopy(model)
    parallelize(checkpointed, None, FSDPConfig(activation_checkpointing=True), "32-true")
    loader = SFTLoader(random_samples([20, 33, 12, 25], seed=6), 40, False, 0, 0, 1, 4, 4, seed=0)
    batch = next(iter(loader))
    model_input = to_device(batch, torch.device("cpu"))
    where = dropout_samples_of([batch], [model_input], 0, seed=3, step=1)[0]
    expected_loss, expected = loss_and_grads(model, model_input, where)
    loss, grads = loss_and_grads(checkpointed, model_input, where)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected.keys() and grads
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)
