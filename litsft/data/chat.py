"""Conversations to training tokens: render with a chat template, tokenize once, and mark the tokens
that carry loss (the assistant's replies and their end-of-turn token).

The assistant spans are found by rendering prefixes of the conversation: the text an assistant reply
occupies is what `render(messages[:i + 1])` adds to `render(messages[:i], add_generation_prompt=True)`.
This works for any template that renders a conversation incrementally (ChatML, Llama 3, Mistral, and
the named styles below) without knowing its markup. Tokenizing the whole text once, and mapping tokens
to spans by character offsets, gives the same tokens as tokenizing the text at generation time.

Decided per record, the same way whatever the template: replies before the conversation's first user
message answer no prompt and are dropped (as FastChat's training drops a first turn that is not the
human's: https://github.com/lm-sys/FastChat/blob/main/fastchat/train/train.py), so that no template
trains on its default system prompt and header before them or refuses the record for them; a record whose
tool calls are malformed (no function name, arguments that are not a JSON object), or that the template
refuses, or whose replies cannot be found in the render, is skipped and counted with its reason
(`skip_invalid`), or stops tokenizing with that reason.

A template that rewrites earlier turns (Qwen3 drops the reasoning of replies before the last user
message) renders a reply differently once later turns follow it. Such a conversation is trained turn by
turn: one sample per assistant reply, the conversation up to that reply as the template renders it when
the reply is the newest, which is what the model sees when it writes that reply.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Literal, NamedTuple

import numpy as np

from litsft.data.tokenizer import Tokenizer, render_template_messages, template_messages
from litsft.errors import LitsftError
from litsft.runtime.files import json_problem

Message = dict[str, Any]
"""{"role": "system" | "user" | "assistant" | "tool", "content": str, ...}: also `tool_calls`, a reasoning field
(`reasoning_content` / `thinking` / `reasoning`), `name` and `tool_call_id`, handed to the template as
transformers hands them."""

TEXT_ROLE = "text"
"""The role of the one message of a plain-text record: trained on every token, without a template."""


class Conversation(list):
    """A conversation's messages, and the tool schemas (`tools`) offered to the model in it, which the chat
    template renders where the model expects them (as transformers' `apply_chat_template(tools=...)`)."""

    def __init__(self, messages: list[Message] = (), tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(messages)
        self.tools = tools


class PreferencePair(Conversation):
    """A preference record: the prompt (the messages of the list itself) and two replies to it, the preferred
    `chosen` and the `rejected`, each a list of messages. Tokenized as two samples, chosen then rejected, each
    the prompt and its reply, of which the reply's tokens alone carry loss."""

    def __init__(
        self,
        prompt: list[Message],
        chosen: list[Message],
        rejected: list[Message],
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(prompt, tools)
        self.chosen, self.rejected = chosen, rejected


def tools_of(messages: list[Message]) -> list[dict[str, Any]] | None:
    return getattr(messages, "tools", None)


PromptStyle = Literal["chatml", "llama3", "alpaca", "plain"]

# Named prompt styles, written as chat templates so they go through the same code as a checkpoint's own.
PROMPT_STYLES: dict[str, str] = {
    # ChatML (Qwen, many fine-tunes), without a default system prompt.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Meta-Llama-3-Instruct's template.
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # Stanford Alpaca's prompt; a reply ends with eos. The user turn already ends in the response header.
    "alpaca": (
        "{% if messages[0]['role'] != 'system' %}{{ 'Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n' }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n### Response:\n' }}"
        "{% else %}{{ message['content'] + eos_token + '\n\n' }}{% endif %}"
        "{% endfor %}"
    ),
    # No markup: one message per line, a reply ends with eos. For base models and text-like data.
    "plain": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token + '\n' }}"
        "{% else %}{{ message['content'] + '\n' }}{% endif %}"
        "{% endfor %}"
    ),
}


class ConversationError(LitsftError):
    """A conversation that cannot become training tokens; `index` is its position in the list given to
    `tokenize_many`, so that the caller can name the record it came from."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(index, problem)  # both in args: the error crosses process boundaries pickled
        self.index, self.problem = index, problem

    def __str__(self) -> str:
        return f"conversation {self.index}: {self.problem}"


Sample = tuple[str, list[tuple[int, int]]]
"""A text to train on and the character spans [start, end) of it that carry loss."""


@dataclass
class TokenizeReport:
    """What tokenizing conversations left out, for the run's log: the conversations skipped, each with its
    index and reason, and how many lost the replies that opened them (before any user message)."""

    conversations: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    opening_replies_dropped: int = 0

    def shifted(self, offset: int) -> TokenizeReport:
        """This report of conversations that start at index `offset` of a longer list."""
        skipped = [(index + offset, problem) for index, problem in self.skipped]
        return TokenizeReport(self.conversations, skipped, self.opening_replies_dropped)

    @staticmethod
    def joined(reports: list[TokenizeReport]) -> TokenizeReport:
        return TokenizeReport(
            sum(report.conversations for report in reports),
            [skipped for report in reports for skipped in report.skipped],
            sum(report.opening_replies_dropped for report in reports),
        )


class Tokenized(NamedTuple):
    """Samples back to back: their tokens, loss targets, one length per sample, and what was left out."""

    tokens: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray
    report: TokenizeReport


class ChatFormat:
    """How conversations become text and training tokens for one tokenizer.

    Args:
        tokenizer: The checkpoint's tokenizer.
        prompt_style: A named style from PROMPT_STYLES, or None for the checkpoint's own chat template
            (falling back to "alpaca" when the checkpoint has none).
        mask_prompt: Only assistant tokens carry loss; False trains on every token.
        skip_invalid: A conversation that cannot be trained on (see the module docstring) is skipped and
            counted in the TokenizeReport; False raises ConversationError for it.
        pairs: Every conversation is a PreferencePair, tokenized as its two samples (a preference objective's
            data); a plain conversation cannot be trained on, nor a pair without it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_style: str | None = None,
        mask_prompt: bool = True,
        skip_invalid: bool = False,
        pairs: bool = False,
    ) -> None:
        if prompt_style is not None and prompt_style not in PROMPT_STYLES:
            raise LitsftError(
                f"unknown prompt style {prompt_style!r}; choose one of {', '.join(PROMPT_STYLES)} "
                "or leave it unset to use the checkpoint's chat template"
            )
        self.tokenizer = tokenizer
        self.mask_prompt = mask_prompt
        self.skip_invalid = skip_invalid
        self.pairs = pairs
        if prompt_style is None and tokenizer.chat_template is not None:
            self.name = "checkpoint"
            self.template = tokenizer.chat_template
        else:
            self.name = prompt_style or "alpaca"
            self.template = PROMPT_STYLES[self.name]
        # Templates refer to special tokens by text; fill in those the tokenizer config only names by id.
        self._variables = dict(tokenizer.special_tokens)
        for key, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
            if key not in self._variables and token_id is not None:
                self._variables[key] = tokenizer.decode([token_id], skip_special_tokens=False)

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as text; with add_generation_prompt, ready for the model to write the reply.
        `tools` defaults to the conversation's own (a `Conversation`'s `tools`)."""
        tools = tools if tools is not None else tools_of(messages)
        return self._render(template_messages(messages), add_generation_prompt, tools)

    def _render(
        self, prepared: list[Message], add_generation_prompt: bool, tools: list[dict[str, Any]] | None
    ) -> str:
        """`render` of messages prepared by `template_messages`: a conversation's prefixes share them."""
        return render_template_messages(
            self.template,
            prepared,
            add_generation_prompt,
            self._variables,
            source=f"the {self.name} chat template",
            fix="choose another --data.prompt_style",
            tools=tools,
        )

    def encode_prompt(self, messages: list[Message]) -> list[int]:
        """Token ids of a prompt for generation, as the model saw prompts in training."""
        text = self.render(messages, add_generation_prompt=True)
        return self._with_bos(self.tokenizer.encode(text, add_bos=False))

    def _eos_text(self) -> str:
        return self._variables.get("eos_token", "")

    def tokenize(self, messages: list[Message]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int32) of the whole conversation, and a bool array: True where the token is a
        loss target (assistant reply and its end-of-turn token; every token with mask_prompt=False).
        A conversation trained turn by turn gives its samples back to back (`tokenize_many` tells them apart)."""
        tokens, targets, _, _ = self.tokenize_many([messages])
        return tokens, targets

    def tokenize_many(self, conversations: list[list[Message]]) -> Tokenized:
        """The samples of many conversations: tokens, targets and lengths, concatenated, one length per
        sample (one sample per conversation, or one per reply for a conversation trained turn by turn), and
        the report of what was left out. Tokenizes in one batch call, and finds the target tokens of all
        samples with one search. A conversation that cannot be trained on is skipped (`skip_invalid`), else
        raises ConversationError naming it."""
        texts, spans = [], []
        report = TokenizeReport(conversations=len(conversations))
        for index, messages in enumerate(conversations):
            try:
                samples = self.samples(messages)
            except LitsftError as err:
                if not self.skip_invalid:
                    raise ConversationError(index, str(err)) from None
                report.skipped.append((index, str(err)))
                continue
            report.opening_replies_dropped += _opens_with_a_reply(messages)
            texts.extend(text for text, _ in samples)
            spans.extend(text_spans for _, text_spans in samples)
        tokens, targets, lengths = _tokens_and_targets(self.tokenizer, texts, spans)
        if self.tokenizer.add_bos:
            # A template that writes bos itself (Llama 3) has it already; add it where it is missing.
            firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            missing = (lengths == 0) | (
                tokens[firsts.clip(max=max(len(tokens) - 1, 0))] != self.tokenizer.bos_id
            )
            if missing.any():
                tokens = np.insert(tokens, firsts[missing], self.tokenizer.bos_id)
                targets = np.insert(targets, firsts[missing], False)
                lengths = lengths + missing
        return Tokenized(tokens, targets, lengths, report)

    def _with_bos(self, ids: list[int]) -> list[int]:
        # A template that wants bos writes it (Llama 3); add it only when encoding wants it and it is missing.
        if self.tokenizer.add_bos and (not ids or ids[0] != self.tokenizer.bos_id):
            return [self.tokenizer.bos_id, *ids]
        return ids

    def samples(self, messages: list[Message]) -> list[Sample]:
        """The texts a conversation trains as, each with its loss spans: the whole conversation when the
        template renders it incrementally, else one sample per reply (turn by turn), else the whole
        conversation with each reply found by search. A plain-text record is its text and eos, all trained.
        A preference pair is its two samples (`pair_samples`)."""
        if isinstance(messages, PreferencePair) or self.pairs:
            return self.pair_samples(messages)
        if len(messages) == 1 and messages[0]["role"] == TEXT_ROLE:
            text = messages[0]["content"] + self._eos_text()
            return [(text, [(0, len(text))])]
        tools = tools_of(messages)
        messages = template_messages(_without_opening_replies(messages))
        _check_trainable(messages)
        text = self._render(messages, False, tools)
        if not self.mask_prompt:
            return [(text, [(0, len(text))])]
        spans = self._assistant_spans(messages, text, tools)
        if spans is not None:
            return [(text, spans)]
        return self._turn_by_turn(messages, tools) or [(text, self._searched_spans(messages, text))]

    def pair_samples(self, pair: list[Message]) -> list[Sample]:
        """A preference pair's two samples, chosen then rejected: the prompt rendered with its reply, the
        reply's characters (after the prompt as rendered for generation) the only ones that carry loss,
        whatever `mask_prompt` says. Refused: a pair in SFT data, a conversation in preference data, a pair
        whose replies render the same, a template that does not render the prompt as their start."""
        if not self.pairs:
            raise LitsftError(
                "a preference pair ('chosen' and 'rejected') in SFT data; train it with a preference objective "
                "(--objective.name dpo) or drop the record"
            )
        if not isinstance(pair, PreferencePair):
            raise LitsftError(
                "not a preference pair: a preference objective trains on records with 'chosen' and 'rejected' "
                "(and optionally 'prompt')"
            )
        tools = tools_of(pair)
        prompt = template_messages(list(pair))
        prompt_text = self._render(prompt, True, tools)
        samples = []
        for reply in (pair.chosen, pair.rejected):
            messages = prompt + template_messages(reply)
            _check_trainable(messages)
            text = self._render(messages, False, tools)
            if not text.startswith(prompt_text):
                raise LitsftError(
                    f"the {self.name} chat template does not render a pair's replies after its prompt as "
                    "rendered for generation, so their tokens cannot be told apart; choose a "
                    "--data.prompt_style such as chatml"
                )
            samples.append((text, [_reply_span(prompt_text, text)]))
        if samples[0][0] == samples[1][0]:
            raise LitsftError(
                "chosen and rejected are the same reply; a preference pair needs two different ones"
            )
        return samples

    def _assistant_spans(
        self, messages: list[Message], text: str, tools: list[dict[str, Any]] | None
    ) -> list[tuple[int, int]] | None:
        """Each reply's span in `text` (messages prepared by `template_messages`); None when an earlier render is not a prefix of the whole."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], True, tools)
            turn = text if i + 1 == len(messages) else self._render(messages[: i + 1], False, tools)
            if not (text.startswith(prompt) and text.startswith(turn) and len(prompt) <= len(turn)):
                return None
            spans.append(_reply_span(prompt, turn))
        return spans

    def _turn_by_turn(
        self, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> list[Sample] | None:
        """One sample per reply: the conversation up to it, as rendered when it is the newest turn. None
        when even that render does not start with the prompt before the reply."""
        samples = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], True, tools)
            turn = self._render(messages[: i + 1], False, tools)
            if not turn.startswith(prompt):
                return None
            samples.append((turn, [_reply_span(prompt, turn)]))
        return samples

    def _searched_spans(self, messages: list[Message], text: str) -> list[tuple[int, int]]:
        """For templates whose renders are not even prefixes turn by turn (one that marks the last message
        differently): find each reply's text in order, and extend it over an end-of-turn token written
        right after it."""
        stop_texts = [self.tokenizer.decode([i], skip_special_tokens=False) for i in self.tokenizer.stop_ids]
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            content = (message.get("content") or "").strip()
            start = text.find(content, cursor)
            if start < 0:
                raise LitsftError(
                    f"the {self.name} chat template does not show assistant message {i} verbatim, so its "
                    "tokens cannot be found for the loss mask; choose a --data.prompt_style such as chatml"
                )
            end = start + len(content)
            for stop in stop_texts:
                if stop and text.startswith(stop, end):
                    end += len(stop)
                    break
            spans.append((start, end))
            cursor = end
        return spans


def _first_user_message(messages: list[Message]) -> int:
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return i
    return len(messages)


def _opens_with_a_reply(messages: list[Message]) -> bool:
    """Whether messages other than system ones (a reply, its tool results) come before the first user one."""
    # A loop that stops at the first user message, not a slice and a generator: this runs twice a record.
    for message in messages:
        if message["role"] == "user":
            return False
        if message["role"] != "system":
            return True
    return False


def _without_opening_replies(messages: list[Message]) -> list[Message]:
    """The conversation from its first user message on, its system messages kept."""
    if not _opens_with_a_reply(messages):
        return messages
    first_user = _first_user_message(messages)
    return [message for message in messages[:first_user] if message["role"] == "system"] + list(
        messages[first_user:]
    )


def _check_trainable(messages: list[Message]) -> None:
    """Raise LitsftError naming what makes a conversation untrainable before any template sees it: no
    reply after a user message, or a malformed tool call."""
    if not any(message["role"] == "assistant" for message in messages):
        raise LitsftError("no assistant reply follows a user message; add one or drop the record")
    for i, message in enumerate(messages):
        if "tool_calls" not in message:  # most messages: no call to check
            continue
        for j, call in enumerate(message["tool_calls"] or []):
            problem = _tool_call_problem(call)
            if problem is not None:
                raise LitsftError(f"message {i} tool_calls[{j}] {problem}; fix the call or drop the record")


def _tool_call_problem(call: Any) -> str | None:
    """What is wrong with one tool call ({"function": {"name", "arguments"}} as OpenAI writes it, or the
    function itself), None when nothing is: templates print the name and the arguments as JSON."""
    if not isinstance(call, dict):
        return f"is {type(call).__name__}, not an object"
    function = call.get("function", call)
    if not isinstance(function, dict):
        return "has a 'function' that is not an object"
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        return "has no function name"
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return f"({name}) has arguments that are not valid JSON ({json_problem(err)})"
    if not isinstance(arguments, dict):
        return f"({name}) has arguments that are not a JSON object"
    return None


def _reply_span(prompt: str, turn: str) -> tuple[int, int]:
    """The reply's characters: what `turn` adds to `prompt`, without the newline that follows the
    end-of-turn token (it is not part of the reply)."""
    return len(prompt), max(len(turn.rstrip()), len(prompt))


ENCODE_BATCH_CHARS = 1 << 19
"""Characters of text encoded in one call into `tokenizers`: each encoding keeps every token's string,
offsets and masks beside its id (about 100 bytes a token) until it is freed, so a chunk's texts are encoded a
batch of texts at a time. 10,000 conversations of ~340 tokens (4.3M characters) encoded at once added 348 MB
to the process at its peak; in batches of 2^19 characters, 77 MB (2^18: 59 MB)."""


def _tokens_and_targets(
    tokenizer: Tokenizer, texts: list[str], spans: list[list[tuple[int, int]]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids of `texts` back to back (without bos or eos), the target flags (a token is a target when
    its first character lies inside one of its text's `spans`), and each text's token count; encoded
    ENCODE_BATCH_CHARS characters at a time (see `_encoded`)."""
    parts = [_encoded(tokenizer, texts[start:stop], spans[start:stop]) for start, stop in _batches(texts)]
    if len(parts) == 1:
        return parts[0]
    tokens, targets, lengths = zip(*parts)
    return np.concatenate(tokens), np.concatenate(targets), np.concatenate(lengths)


def _batches(texts: list[str]) -> Iterator[tuple[int, int]]:
    """(start, stop) of runs of `texts` of at most ENCODE_BATCH_CHARS characters (a longer text alone);
    one empty run when there are no texts."""
    start, characters = 0, 0
    for index, text in enumerate(texts):
        if index > start and characters + len(text) > ENCODE_BATCH_CHARS:
            yield start, index
            start, characters = index, 0
        characters += len(text)
    yield start, len(texts)


def _encoded(
    tokenizer: Tokenizer, texts: list[str], spans: list[list[tuple[int, int]]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_tokens_and_targets` of some texts, in one parallel call into `tokenizers`."""
    encodings = tokenizer._tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(encoding) for encoding in encodings), dtype=np.int64, count=len(encodings))
    total = int(lengths.sum())
    tokens = np.fromiter(
        chain.from_iterable(encoding.ids for encoding in encodings), dtype=np.int32, count=total
    )
    targets = np.zeros(total, dtype=bool)
    base = 0
    for encoding, text, text_spans in zip(encodings, texts, spans):
        for start, end in text_spans:
            first = _first_token_at(encoding, start, len(text))
            targets[base + first : base + _first_token_at(encoding, end, len(text))] = True
        base += len(encoding)
    return tokens, targets, lengths


def _first_token_at(encoding: Any, position: int, text_length: int) -> int:
    """The index of the first token of `encoding` whose first character is at or after `position` (the
    number of tokens when there is none). Asks `tokenizers` for the token at that character and steps over
    its neighbours, instead of reading every token's offsets (building those lists took a third of
    tokenizing a chunk). Token start offsets never decrease along an encoding: a span of characters is a
    run of tokens."""
    token = encoding.char_to_token(position) if position < text_length else len(encoding)
    if token is None:  # a character no token covers (one the normalizer removed): search the offsets
        return bisect.bisect_left([start for start, _ in encoding.offsets], position)
    # Tokens of one character's bytes share its offsets: step back to the first, or past one that starts before.
    while token > 0 and encoding.token_to_chars(token - 1)[0] >= position:
        token -= 1
    while token < len(encoding) and encoding.token_to_chars(token)[0] < position:
        token += 1
    return token
