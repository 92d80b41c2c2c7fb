"""The CPU's per-document attention for packed batches (litsft/model.py) against the boolean-mask path."""

from __future__ import annotations

import torch

from litsft.config import Config
from litsft.model import Transformer, attention_mask, document_segments, rope_cos_sin


def test_segmented_attention_equals_the_mask_path():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(Config.from_name("tiny-llama"))
    # Two rows: documents of 70, 3, 1 and 30 tokens then 24 of padding (its own "document", as in the
    # mask); documents of 100 and 28.
    document_ids = torch.tensor([[0] * 70 + [1] * 3 + [2] + [3] * 30 + [-1] * 24, [0] * 100 + [1] * 28])
    position_ids = torch.cat([torch.arange(n) for n in (70, 3, 1, 30, 24, 100, 28)]).view(2, 128)
    input_ids = torch.randint(0, 512, (2, 128))
    segments = document_segments(document_ids)
    assert [g.shape[1] for g in segments.gather] == [100, 70, 30]  # 30, 28, 24, 3, 1 share a bucket
    cos, sin = rope_cos_sin(model.config, position_ids, torch.float32)
    results = {}
    for name, mask in (("segments", segments), ("mask", attention_mask(document_ids))):
        model.zero_grad()
        hidden = model.embed(input_ids)
        for block in model.blocks:
            hidden = block(hidden, cos, sin, mask)
        logits = model.lm_head(model.norm(hidden))
        logits[document_ids >= 0].square().mean().backward()
        results[name] = (logits.detach(), model.blocks[0].attn.q_proj.weight.grad.clone())
    keep = document_ids >= 0
    torch.testing.assert_close(results["segments"][0][keep], results["mask"][0][keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(results["segments"][1], results["mask"][1], atol=1e-5, rtol=1e-4)
