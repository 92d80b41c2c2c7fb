"""`litsft chat`: a conversation driven through standard input, each reply equal to transformers' greedy
generation on the same history rendered by the same chat template."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from launch import litsft_in_process
from tiny_hf import save_tiny_hf, tiny_hf_model

from litsft.inference.chat import TextStream

MAX_NEW_TOKENS = 12


def transformers_replies(hf_dir: Path, turns: list[str], system: str) -> list[str]:
    """Each reply of a conversation where every user turn is answered by greedy decoding in transformers, on
    the history so far rendered by the tokenizer's chat template (a line "/reset" starts it over)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    opening = [{"role": "system", "content": system}]
    messages, replies = list(opening), []
    for turn in turns:
        if turn == "/reset":
            messages = list(opening)
            continue
        messages.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        reply = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def test_a_three_turn_conversation_and_a_reset_reply_as_transformers_greedy_generation(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_dir = save_tiny_hf(tiny_hf_model("llama", seed=5), tmp_path / "tiny-llama")
    turns = ["alpha beta", "gamma?", "delta epsilon zeta", "/reset", "alpha beta", "/exit", "never read"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{turn}\n" for turn in turns)))
    args = ["chat", str(hf_dir), "--system_prompt", "Be brief.", "--max_new_tokens", str(MAX_NEW_TOKENS)]
    result = litsft_in_process([*args, "--dtype", "float32"], tmp_path, capsys)
    replies = result.stdout.splitlines()[-4:]
    expected = transformers_replies(hf_dir, turns[:5], "Be brief.")
    assert replies == expected
    assert replies[0] == replies[3]  # after /reset the conversation starts over
    assert len(set(replies[:3])) > 1  # the history changes what the model says


def test_the_stream_prints_each_character_once_whole(tokenizer) -> None:
    """Streaming prints the reply's text once, whatever the tokens split (multi-byte characters included)."""
    text = "héllo wörld, 你好 ok"
    ids = tokenizer.encode(text, add_bos=False)
    stream = TextStream(tokenizer)
    printed = "".join(stream.push(token) for token in ids) + stream.rest()
    assert printed == tokenizer.decode(ids)
    assert "\ufffd" not in printed
