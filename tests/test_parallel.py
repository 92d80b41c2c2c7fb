"""litsft/parallel.py: what `parallelize` does to a model, on one process (sharding itself is checked end to
end by the distributed-equivalence tests in test_engine.py)."""

from __future__ import annotations

import torch

from litsft.args import FSDPConfig
from litsft.config import Config
from litsft.model import Transformer
from litsft.parallel import parallelize


def model_and_batch() -> tuple[Transformer, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    model.init_weights(1)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    return model, {"input_ids": tokens, "labels": tokens}


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
