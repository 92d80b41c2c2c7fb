"""Chat formatting and the loss mask (litsft/data/chat.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_tokenizer import write_tiny_tokenizer

from litsft.data.chat import ChatFormat, Conversation
from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And the red cat?"},
    {"role": "assistant", "content": "The cat sings today!"},
]
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def template_tokenizer(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    write_tiny_tokenizer(directory, chat_template=request.param)
    return request.param, Tokenizer(directory)


def pieces(tokenizer: Tokenizer, ids) -> list[str]:
    return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]


def test_exactly_the_assistant_tokens_are_targets(template_tokenizer):
    name, tokenizer = template_tokenizer
    chat_format = ChatFormat(tokenizer)
    assert chat_format.name == "checkpoint"
    tokens, targets = chat_format.tokenize(CONVERSATION)
    # The tokens are the ones generation would see: the rendered template, encoded as a whole.
    assert tokens.tolist() == tokenizer.encode(tokenizer.render_chat(CONVERSATION), add_bos=False)
    target_pieces = pieces(tokenizer, tokens[targets])
    print(name, "targets:", target_pieces)
    print(name, "others: ", pieces(tokenizer, tokens[~targets]))
    # Each reply, then its end-of-turn token, and nothing else: no system, user or header token.
    expected = []
    for message in CONVERSATION:
        if message["role"] == "assistant":
            expected += pieces(tokenizer, tokenizer.encode(message["content"], add_bos=False))
            expected.append(END_OF_TURN[name])
    assert target_pieces == expected
    assert "".join(target_pieces) == f"It is 5.{END_OF_TURN[name]}The cat sings today!{END_OF_TURN[name]}"


def test_llama3_bos_is_written_once(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template="llama3")
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.add_bos
    tokens, targets = ChatFormat(tokenizer).tokenize(CONVERSATION)
    assert tokens[0] == tokenizer.bos_id and tokens[1] != tokenizer.bos_id and not targets[0]


def test_training_on_everything(template_tokenizer):
    _, tokenizer = template_tokenizer
    tokens, targets = ChatFormat(tokenizer, mask_prompt=False).tokenize(CONVERSATION)
    assert targets.all() and len(tokens) > 20


def test_named_style_over_a_template_less_checkpoint(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template=None)
    tokenizer = Tokenizer(tmp_path)
    chat_format = ChatFormat(tokenizer)
    assert chat_format.name == "alpaca"  # the default when the checkpoint has no template
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    assert chat_format.render(messages) == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nSay hi\n\n### Response:\nhi<|end_of_text|>\n\n"
    )
    tokens, targets = chat_format.tokenize(messages)
    assert tokens[0] == tokenizer.bos_id  # the tokenizer adds bos and alpaca does not write it
    assert pieces(tokenizer, tokens[targets]) == ["hi", "<|end_of_text|>"]
    prompt = chat_format.encode_prompt(messages[:1])
    assert prompt == tokens[: len(prompt)].tolist()
    assert (
        tokenizer.decode(tokens[len(prompt) :].tolist(), skip_special_tokens=False) == "hi<|end_of_text|>\n\n"
    )


def test_prompt_style_overrides_the_checkpoint_template(template_tokenizer):
    _, tokenizer = template_tokenizer
    chat_format = ChatFormat(tokenizer, prompt_style="plain")
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    assert chat_format.render(messages) == "Say hi\nhi<|end_of_text|>\n"


def test_unknown_prompt_style(template_tokenizer):
    with pytest.raises(LitsftError) as error:
        ChatFormat(template_tokenizer[1], prompt_style="vicuna")
    assert str(error.value) == (
        "unknown prompt style 'vicuna'; choose one of chatml, llama3, alpaca, plain or leave it unset "
        "to use the checkpoint's chat template"
    )


def test_template_that_rewrites_history_falls_back_to_search(tmp_path):
    # The last reply gets another header than earlier ones, so earlier renders are not prefixes.
    write_tiny_tokenizer(tmp_path, chat_template="chatml")
    tokenizer = Tokenizer(tmp_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{% set head = 'final' if loop.last else m['role'] %}"
        "{{ '<|im_start|>' + head + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>final\\n' }}{% endif %}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "two"},
    ]
    tokens, targets = ChatFormat(tokenizer).tokenize(messages)
    assert "".join(pieces(tokenizer, tokens[targets])) == "one<|im_end|>two<|im_end|>"

    # Not a prefix either, and the replies are cut short: nothing to find.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ ('*' if loop.last else '') + m['role'] + ': ' + m['content'][:2] + '\\n' }}"
        "{% endfor %}"
    )
    with pytest.raises(LitsftError) as error:
        ChatFormat(tokenizer).tokenize(messages)
    assert str(error.value) == (
        "conversation 0: the checkpoint chat template does not show assistant message 1 verbatim, so its "
        "tokens cannot be found for the loss mask; choose a --data.prompt_style such as chatml"
    )


# Qwen3's template in miniature: replies before the last user message lose their reasoning (everything up
# to </think>), as in https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/tokenizer_config.json.
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_query and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
REASONING_CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 5."},
    {"role": "user", "content": "And the red cat?"},
    {"role": "assistant", "content": "<think>\nthink of cats\n</think>\n\nThe cat sings today!"},
]


def test_a_template_that_drops_past_reasoning_is_trained_turn_by_turn(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template="chatml")
    tokenizer = Tokenizer(tmp_path)
    tokenizer.chat_template = REASONING_TEMPLATE
    chat_format = ChatFormat(tokenizer)
    whole = chat_format.render(REASONING_CONVERSATION)
    assert "add them" not in whole and "It is 5." in whole  # the template rewrote the first reply

    tokens, targets, lengths, _ = chat_format.tokenize_many([REASONING_CONVERSATION])
    assert len(lengths) == 2  # one sample per reply
    first, second = np.split(np.arange(len(tokens)), [lengths[0]])
    # Each sample is the conversation up to its reply, as the template renders it when that reply is newest.
    for sample, upto in ((first, 2), (second, 4)):
        text = chat_format.render(REASONING_CONVERSATION[:upto])
        assert tokens[sample].tolist() == tokenizer.encode(text, add_bos=False)
    assert "".join(pieces(tokenizer, tokens[first][targets[first]])) == (
        "<think>\nadd them\n</think>\n\nIt is 5.<|im_end|>"
    )
    # The second sample shows the first reply without its reasoning and trains only on the second reply.
    assert "add them" not in tokenizer.decode(tokens[second].tolist(), skip_special_tokens=False)
    assert "".join(pieces(tokenizer, tokens[second][targets[second]])) == (
        "<think>\nthink of cats\n</think>\n\nThe cat sings today!<|im_end|>"
    )
    # A conversation the template renders incrementally stays one sample.
    assert len(chat_format.tokenize_many([REASONING_CONVERSATION[:2]])[2]) == 1


# ---- the loss mask of real templates ---------------------------------------------------------------------
# Each family's own chat template (tests/fixtures/chat_templates, with its source), rendered with a tiny
# tokenizer. The tokens must be what transformers' apply_chat_template gives for the same messages and tools
# (so tools, tool calls and reasoning reach the template as transformers hands them), and the tokens that
# carry loss, decoded, must be exactly each assistant turn and its end-of-turn token. None of these templates
# marks its assistant turns with {% generation %}, so transformers' return_assistant_tokens_mask cannot
# check them; the masked text is written out below from each template's markup.
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call00001",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "call00001", "content": "sunny"},
    {"role": "assistant", "content": "Sunny in Paris."},
]
THINKING_CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5.", "reasoning_content": "add them"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "ask the tool"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Sunny in Paris.", "reasoning_content": "it said sunny"},
]
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EOS = "<|end_of_text|>"  # the tiny tokenizer's eos, which templates write as eos_token
# family: (template file, conversation, tools, [(messages the sample holds, its masked text), ...]):
# one sample for a template that renders the conversation incrementally, else one per assistant turn.
FAMILIES = {
    "llama-3.1": (
        "llama-3.1.jinja",
        TOOL_CONVERSATION,
        TOOLS,
        [
            (
                7,
                'It is 5.<|eot_id|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>Sunny in Paris.<|eot_id|>',
            )
        ],
    ),
    "qwen2.5": (
        "qwen2.5.jinja",
        TOOL_CONVERSATION,
        TOOLS,
        [(7, f"It is 5.<|im_end|>{QWEN_CALL}<|im_end|>Sunny in Paris.<|im_end|>")],
    ),
    # Qwen3 shows reasoning only after the last user query, so each turn is its own sample.
    "qwen3": (
        "qwen3.jinja",
        THINKING_CONVERSATION,
        TOOLS,
        [
            (2, "<think>\nadd them\n</think>\n\nIt is 5.<|im_end|>"),
            (4, f"<think>\nask the tool\n</think>\n\n{QWEN_CALL}<|im_end|>"),
            (6, "<think>\nit said sunny\n</think>\n\nSunny in Paris.<|im_end|>"),
        ],
    ),
    # Mistral writes the tools before the last user message, which moves as the conversation grows.
    "mistral-v0.3": (
        "mistral-v0.3.jinja",
        TOOL_CONVERSATION,
        TOOLS,
        [
            (3, f" It is 5.{EOS}"),
            (
                5,
                f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "call00001"}}]{EOS}',
            ),
            (7, f" Sunny in Paris.{EOS}"),
        ],
    ),
    "smollm2": (
        "smollm2.jinja",
        CONVERSATION,
        None,
        [(5, "It is 5.<|im_end|>The cat sings today!<|im_end|>")],
    ),
}


def with_real_template(directory: Path, template: str) -> tuple[Tokenizer, Any]:
    """The tiny tokenizer with a real template (a file of TEMPLATES), as litsft and transformers load it."""
    from transformers import AutoTokenizer

    write_tiny_tokenizer(directory, chat_template="chatml")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / template).read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(directory), AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_templates_mask_exactly_the_assistant_turns(family, tmp_path):
    template, conversation, tools, expected = FAMILIES[family]
    tokenizer, hf = with_real_template(tmp_path, template)

    tokens, targets, lengths, _ = ChatFormat(tokenizer).tokenize_many([Conversation(conversation, tools)])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    assert len(lengths) == len(expected)
    for (upto, masked), start, end in zip(expected, starts[:-1], starts[1:]):
        text = hf.apply_chat_template(conversation[:upto], tools=tools, tokenize=False)
        assert tokens[start:end].tolist() == hf.encode(text, add_special_tokens=False)
        assert (
            tokenizer.decode(tokens[start:end][targets[start:end]].tolist(), skip_special_tokens=False)
            == masked
        )


# Gemma has no system role: Gemma 2's template refuses a system message, Gemma 3's puts it at the head of the
# first user turn (tests/fixtures/chat_templates/SOURCES.md).
GEMMA2_TEMPLATE = (TEMPLATES / "gemma-2.jinja").read_text()
GEMMA3_TEMPLATE = (TEMPLATES / "gemma-3.jinja").read_text()


def test_gemma_templates_and_the_system_role(tmp_path):
    """Gemma 3's template folds the system message into the first user turn and the mask still covers the
    replies only; Gemma 2's refuses it, and a record with a system message fails in one line that says how."""
    write_tiny_tokenizer(tmp_path, chat_template="llama3")
    tokenizer = Tokenizer(tmp_path)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    chat_format = ChatFormat(tokenizer)
    assert chat_format.render(CONVERSATION[:2], add_generation_prompt=True) == (
        "<|begin_of_text|><start_of_turn>user\nYou answer in one line.\n\nWhat is 2 + 3?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    tokens, targets = chat_format.tokenize(CONVERSATION)
    assert (
        "".join(pieces(tokenizer, tokens[targets]))
        == "It is 5.<end_of_turn>The cat sings today!<end_of_turn>"
    )

    tokenizer.chat_template = GEMMA2_TEMPLATE
    tokens, targets = ChatFormat(tokenizer).tokenize(CONVERSATION[1:])
    assert (
        "".join(pieces(tokenizer, tokens[targets]))
        == "It is 5.<end_of_turn>The cat sings today!<end_of_turn>"
    )
    with pytest.raises(LitsftError) as error:
        ChatFormat(tokenizer).tokenize(CONVERSATION)
    assert str(error.value) == (
        "conversation 0: the checkpoint chat template failed on this conversation: System role not supported; "
        "fix the messages, or choose another --data.prompt_style"
    )


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_reaches_the_template_under_each_of_its_names(field, tmp_path):
    """transformers hands a message's `thinking` or `reasoning` to the template as `reasoning_content` too:
    Qwen3's template must show it in <think>, not an empty block."""
    tokenizer, hf = with_real_template(tmp_path, "qwen3.jinja")
    conversation = [
        {key.replace("reasoning_content", field): value for key, value in message.items()}
        for message in THINKING_CONVERSATION
    ]
    tokens, targets, lengths, _ = ChatFormat(tokenizer).tokenize_many([Conversation(conversation, TOOLS)])
    last = slice(int(lengths[:-1].sum()), None)  # the sample of the last reply: its reasoning is shown
    text = hf.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    assert tokens[last].tolist() == hf.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokens[last][targets[last]].tolist(), skip_special_tokens=False) == (
        "<think>\nit said sunny\n</think>\n\nSunny in Paris.<|im_end|>"
    )


# ---- records no template can train as they are -----------------------------------------------------------
EVERY_TEMPLATE = sorted(path.name for path in TEMPLATES.glob("*.jinja"))
# FastChat's ShareGPT data has conversations that open with the assistant's greeting.
OPENS_WITH_A_REPLY = [
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And the red cat?"},
    {"role": "assistant", "content": "The cat sings today!"},
]
# What each template writes around a reply: after its header, and its end-of-turn token.
REPLY_MARKUP = {
    "gemma-2.jinja": ("", "<end_of_turn>"),
    "gemma-3.jinja": ("", "<end_of_turn>"),
    "llama-3.1.jinja": ("", "<|eot_id|>"),
    "mistral-v0.3.jinja": (" ", EOS),
    "qwen2.5.jinja": ("", "<|im_end|>"),
    "qwen3.jinja": ("<think>\n\n</think>\n\n", "<|im_end|>"),  # an empty reasoning block opens a reply
    "smollm2.jinja": ("", "<|im_end|>"),
}


def assert_samples_are_transformers_renders(tokenizer, hf, tokenized, conversation, tools=None) -> str:
    """Each sample is transformers' render of `conversation` up to a reply (the whole of it for a template
    that renders incrementally); returns the text of the loss targets of all samples."""
    tokens, targets, lengths, _ = tokenized
    replies = [i + 1 for i, message in enumerate(conversation) if message["role"] == "assistant"]
    ends = replies if len(lengths) > 1 else [len(conversation)]
    assert len(lengths) == len(ends)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for upto, start, end in zip(ends, starts[:-1], starts[1:]):
        text = hf.apply_chat_template(conversation[:upto], tools=tools, tokenize=False)
        assert tokens[start:end].tolist() == hf.encode(text, add_special_tokens=False)
    return tokenizer.decode(tokens[targets].tolist(), skip_special_tokens=False)


@pytest.mark.parametrize("template", EVERY_TEMPLATE)
def test_a_reply_before_any_user_message_is_left_out_the_same_way_by_every_template(template, tmp_path):
    """Qwen2.5 and Llama 3.1 would train on their default system prompt and the assistant header before such a
    reply (66 and 74 tokens); Gemma and Mistral refuse the record. Every template trains the conversation from
    its first user message on, as transformers renders that, with the loss on the replies and end-of-turn
    tokens only."""
    assert set(EVERY_TEMPLATE) == set(REPLY_MARKUP)
    tokenizer, hf = with_real_template(tmp_path, template)
    tokenized = ChatFormat(tokenizer).tokenize_many([OPENS_WITH_A_REPLY])
    masked = assert_samples_are_transformers_renders(tokenizer, hf, tokenized, OPENS_WITH_A_REPLY[1:])
    before, end_of_turn = REPLY_MARKUP[template]
    replies = ["It is 5.", "The cat sings today!"]
    # Qwen3 trains turn by turn, each reply the newest of its sample, with the empty reasoning block.
    assert masked == "".join(f"{before}{reply}{end_of_turn}" for reply in replies)
    assert tokenized.report.opening_replies_dropped == 1 and not tokenized.report.skipped
    # A system message before the opening reply stays (Gemma 2 refuses it, which the next test covers).
    if template != "gemma-2.jinja":
        with_system = [{"role": "system", "content": "Be brief."}, *OPENS_WITH_A_REPLY]
        tokenized = ChatFormat(tokenizer).tokenize_many([with_system])
        assert_samples_are_transformers_renders(tokenizer, hf, tokenized, with_system[:1] + with_system[2:])


@pytest.mark.parametrize("template", EVERY_TEMPLATE)
def test_records_a_template_refuses_or_with_malformed_tool_calls_are_skipped_and_counted(template, tmp_path):
    """Each record is decided on its own: one the template refuses (Gemma 2: a system message; Gemma and
    Mistral: roles that do not alternate), or with a tool call without a name or with arguments that are not
    JSON, is skipped with its reason; the others train as transformers renders them. Without skip_invalid the
    first one stops tokenizing, naming it."""
    tokenizer, hf = with_real_template(tmp_path, template)
    good = CONVERSATION[1:3]
    two_users = [CONVERSATION[1], CONVERSATION[3], CONVERSATION[2]]
    nameless = {"function": {"name": "", "arguments": {"city": "Paris"}}}
    not_json = {"function": {"name": "get_weather", "arguments": '{"city": Paris}'}}
    tool_calls = [
        [CONVERSATION[1], {"role": "assistant", "tool_calls": [call]}] for call in (nameless, not_json)
    ]
    # Arguments as OpenAI writes them, a JSON string: valid, so rendered as transformers renders them.
    as_string = {"id": "call00001", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    string_call = [CONVERSATION[1], {"role": "assistant", "content": "", "tool_calls": [as_string]}]
    conversations = [good, CONVERSATION, two_users, *tool_calls, good, string_call]
    tokenized = ChatFormat(tokenizer, skip_invalid=True).tokenize_many(conversations)
    skipped = dict(tokenized.report.skipped)
    refused = {"gemma-2.jinja": {1, 2}, "gemma-3.jinja": {2}, "mistral-v0.3.jinja": {2}}.get(template, set())
    assert set(skipped) == refused | {3, 4}
    assert skipped[3] == "message 1 tool_calls[0] has no function name; fix the call or drop the record"
    assert skipped[4] == (
        "message 1 tool_calls[0] (get_weather) has arguments that are not valid JSON (Expecting value at "
        "column 10); fix the call or drop the record"
    )
    if template == "gemma-2.jinja":
        assert skipped[1].endswith("failed on this conversation: System role not supported; fix the messages, or "
                                   "choose another --data.prompt_style")  # fmt: skip
    for index in refused - {1}:
        assert "roles must alternate user/assistant/user/assistant/..." in skipped[index]
    trained = [conversation for index, conversation in enumerate(conversations) if index not in skipped]
    one_by_one = [ChatFormat(tokenizer).tokenize_many([conversation]) for conversation in trained]
    assert tokenized.tokens.tolist() == [token for part in one_by_one for token in part.tokens.tolist()]
    for conversation, part in zip(trained, one_by_one):
        assert_samples_are_transformers_renders(tokenizer, hf, part, conversation)
    with pytest.raises(LitsftError, match=r"^conversation 1: message 1 tool_calls\[0\] has no function name"):
        ChatFormat(tokenizer).tokenize_many(conversations[:1] + conversations[3:])


def test_texts_are_encoded_a_bounded_batch_at_a_time_into_the_same_tokens(template_tokenizer, monkeypatch):
    """A chunk's texts go to `tokenizers` ENCODE_BATCH_CHARS characters at a time (each encoding holds
    about 100 bytes a token until freed; a text longer than that alone): the tokens, targets and lengths are
    those of one call over every text."""
    from litsft.data import chat

    _, tokenizer = template_tokenizer
    conversations = [CONVERSATION[: 3 + index % 3] for index in range(40)]
    whole = ChatFormat(tokenizer).tokenize_many(conversations)
    characters = len(tokenizer.render_chat(CONVERSATION))
    monkeypatch.setattr(chat, "ENCODE_BATCH_CHARS", 3 * characters)
    encode_batch, batches = tokenizer._tokenizer.encode_batch, []

    def recorded(texts, **options):
        batches.append(sum(map(len, texts)))
        return encode_batch(texts, **options)

    monkeypatch.setattr(
        tokenizer, "_tokenizer", type("Encoder", (), {"encode_batch": staticmethod(recorded)})
    )
    batched = ChatFormat(tokenizer).tokenize_many(conversations)
    assert len(batches) > 10 and max(batches) <= 3 * characters, batches
    for name in ("tokens", "targets", "lengths"):
        np.testing.assert_array_equal(getattr(batched, name), getattr(whole, name))
    monkeypatch.setattr(chat, "ENCODE_BATCH_CHARS", 1)  # every text longer than a batch: one at a time
    batches.clear()
    np.testing.assert_array_equal(ChatFormat(tokenizer).tokenize_many(conversations).tokens, whole.tokens)
    assert len(batches) == len(conversations)


@pytest.mark.parametrize("text", ["It is 5.<|im_end|>\n", "Grüße, 猫 🐈 and  two  spaces\n\n", ""])
def test_the_first_token_at_a_position_is_the_one_the_offsets_give(template_tokenizer, text):
    """Targets are found from the tokens at the spans' bounds: for every position, the same token as the
    first whose start offset is at or after it (multi-byte characters split into several byte tokens)."""
    from litsft.data.chat import _first_token_at

    _, tokenizer = template_tokenizer
    encoding = tokenizer._tokenizer.encode(text, add_special_tokens=False)
    starts = [start for start, _ in encoding.offsets]
    for position in range(len(text) + 1):
        expected = next((i for i, start in enumerate(starts) if start >= position), len(starts))
        assert _first_token_at(encoding, position, len(text)) == expected, position
