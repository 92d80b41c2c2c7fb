"""Bytes that dtype casts move in one bf16-mixed training step of litsft's model, by what is cast.

python benchmarks/count_casts.py [--layers 4] [--hidden 1024] [--seq_len 2048] [--vocab 32000]

Runs one forward and backward of a Llama-shaped model (GQA 4:1, MLP 4x, tied embeddings) under CPU bf16
autocast, as Fabric's bf16-mixed precision does on one device, and records every `aten._to_copy` between
fp32 and a 16-bit dtype: its bytes read + written, and whether it cast a parameter (a weight) or an
activation/gradient. Counting runs on the CPU; the split is the same on a GPU (same autocast rules), only the
time per byte differs. Used for benchmarks/results/README.md's note on full fine-tuning's casts.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from litsft.model.config import Config
from litsft.model.network.transformer import Transformer


class CastCounter(TorchDispatchMode):
    def __init__(self, parameters: set[int]) -> None:
        super().__init__()
        self.parameters = parameters
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            source = args[0]
            if source.dtype != out.dtype and torch.float32 in (source.dtype, out.dtype):
                kind = "weight" if source.untyped_storage().data_ptr() in self.parameters else "activation"
                key = f"{kind} {str(source.dtype)[6:]}->{str(out.dtype)[6:]}"
                self.bytes[key] += source.nbytes + out.nbytes
                self.calls[key] += 1
        return out


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    heads = args.hidden // 64
    config = Config(
        name="casts", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4), tie_word_embeddings=True,
        max_position_embeddings=args.seq_len,
    )  # fmt: skip
    model = Transformer(config).train()
    input_ids = torch.randint(0, args.vocab, (1, args.seq_len))
    labels = input_ids.roll(-1, 1)
    counter = CastCounter({p.untyped_storage().data_ptr() for p in model.parameters()})
    with counter:
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(input_ids, labels=labels)
        loss.backward()
    weights = sum(p.numel() for p in model.parameters())
    print(f"{weights / 1e6:.1f}M parameters ({weights * 4 / 2**20:,.0f} MiB fp32), {args.layers} layers, hidden "
          f"{args.hidden}, vocab {args.vocab}, {args.seq_len} tokens, one forward + backward under bf16 autocast")  # fmt: skip
    total = sum(counter.bytes.values())
    for key, size in sorted(counter.bytes.items(), key=lambda item: -item[1]):
        print(f"{key:28s} {counter.calls[key]:5d} casts {size / 2**20:10,.1f} MiB  {size / total:6.1%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    main(parser.parse_args())
