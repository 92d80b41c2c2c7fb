"""Tokenizing 100k demo records (render the chat template, tokenize, mask): prints the rate.

python benchmarks/bench_tokenize.py [--num_records 100000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from litsft.data.chat import ChatFormat
from litsft.data.demo import build_demo_tokenizer, generate_examples
from litsft.data.records import to_conversation
from litsft.data.samples import tokenize_conversations
from litsft.data.tokenizer import Tokenizer


def main(num_records: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        build_demo_tokenizer(Path(directory))
        tokenizer = Tokenizer(directory)
    conversations = [to_conversation(record) for record in generate_examples(num_records)]
    chat_format = ChatFormat(tokenizer)
    start = time.perf_counter()
    samples, _ = tokenize_conversations(conversations, chat_format)
    seconds = time.perf_counter() - start
    print(
        f"tokenized {len(samples):,} records ({len(samples.tokens):,} tokens) in {seconds:.2f} s: "
        f"{len(samples) / seconds:,.0f} records/s, {len(samples.tokens) / seconds:,.0f} tokens/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_records", type=int, default=100_000)
    main(parser.parse_args().num_records)
