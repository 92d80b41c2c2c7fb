"""The tokenizer of a checkpoint directory: Hugging Face's `tokenizers` for the text, jinja2 for the chat
template. Nothing from the directory is executed: no `AutoTokenizer`, no remote code."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from litsft.errors import LitsftError
from litsft.runtime.files import first_line, read_json

# The special tokens transformers hands a chat template as variables, when the tokenizer defines them.
TEMPLATE_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Text <-> token ids, special token ids, and chat-template rendering for one checkpoint directory.

    Reads tokenizer.json (required), and when present tokenizer_config.json, generation_config.json and
    chat_template.jinja: the same files for a Hugging Face checkpoint and a litsft one.

    Attributes:
        vocab_size: Number of token ids the tokenizer can produce, added tokens included.
        bos_id: Beginning-of-sequence id, or None when the tokenizer has none (Qwen).
        eos_id: End-of-sequence id: appended to training samples.
        pad_id: Padding id; the eos id when the tokenizer defines no pad token. Padded positions are
            masked out of the loss, so reusing eos is safe.
        stop_ids: Ids that end generation: eos plus generation_config.json's `eos_token_id`
            (e.g. Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>`).
        add_bos: Whether `encode` prepends bos by default: tokenizer_config.json's `add_bos_token`, else
            whether tokenizer.json's post-processor adds it.
        chat_template: The jinja chat template, or None.
    """

    def __init__(self, checkpoint_dir: Path | str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        tokenizer_file = self.checkpoint_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise LitsftError(
                f"{tokenizer_file} is missing; copy tokenizer.json (and tokenizer_config.json) from the "
                "original Hugging Face checkpoint into the directory"
            )
        self._tokenizer = read_tokenizer_file(tokenizer_file)
        config = _read_json(self.checkpoint_dir / "tokenizer_config.json")
        generation_config = _read_json(self.checkpoint_dir / "generation_config.json")

        # Special tokens by their text, as transformers passes them to chat templates.
        self.special_tokens: dict[str, str] = {}
        for key in TEMPLATE_SPECIAL_TOKENS:
            token = config.get(key)
            if isinstance(token, dict):  # a serialized AddedToken
                token = token.get("content")
            if isinstance(token, str):
                self.special_tokens[key] = token

        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._token_id("bos_token")
        if self.bos_id is None and isinstance(generation_config.get("bos_token_id"), int):
            self.bos_id = generation_config["bos_token_id"]
        generation_eos = generation_config.get("eos_token_id")
        generation_eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        eos_id = self._token_id("eos_token")
        if eos_id is None:
            if not generation_eos:
                raise LitsftError(
                    f"{self.checkpoint_dir} defines no eos token; set `eos_token` in tokenizer_config.json "
                    "or `eos_token_id` in generation_config.json"
                )
            eos_id = generation_eos[0]
        self.eos_id: int = eos_id
        pad_id = self._token_id("pad_token")
        self.pad_id: int = self.eos_id if pad_id is None else pad_id
        self.stop_ids: list[int] = list(dict.fromkeys([self.eos_id, *generation_eos]))

        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            with_special = self._tokenizer.encode("a", add_special_tokens=True).ids
            add_bos = self.bos_id is not None and with_special[0] == self.bos_id
        self.add_bos: bool = add_bos and self.bos_id is not None

        self.chat_template = self._read_chat_template(config)

    # ---- encoding and decoding -------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) map to their ids.

        Args:
            text: The text to encode.
            add_bos: Prepend bos; None means `self.add_bos`. A rendered chat template writes bos itself
                when the model wants one, so encode it with add_bos=False.
            add_eos: Append eos.
        """
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return self._add_special(ids, add_bos, add_eos)

    def encode_batch(
        self, texts: list[str], add_bos: bool | None = None, add_eos: bool = False
    ) -> list[list[int]]:
        """`encode` for many texts at once, in parallel threads inside `tokenizers`."""
        # encode_batch_fast skips computing offsets; tokenizers < 0.21 only has encode_batch.
        encode_batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        encodings = encode_batch(texts, add_special_tokens=False)
        return [self._add_special(encoding.ids, add_bos, add_eos) for encoding in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    # ---- chat template -------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The conversation as text, exactly as transformers' `apply_chat_template(..., tokenize=False)`.

        Args:
            messages: [{"role": "system" | "user" | "assistant", "content": ...}, ...].
            add_generation_prompt: End with the header that opens an assistant turn, for generation.
        """
        if self.chat_template is None:
            raise LitsftError(
                f"{self.checkpoint_dir} has no chat template (no `chat_template` in tokenizer_config.json and "
                "no chat_template.jinja); use a named prompt style instead, or add a template to the checkpoint"
            )
        return render_template_messages(
            self.chat_template,
            template_messages(messages),
            add_generation_prompt,
            self.special_tokens,
            source=f"the chat template of {self.checkpoint_dir}",
            fix="use a named prompt style instead of the checkpoint's template",
        )

    def _read_chat_template(self, config: dict[str, Any]) -> str | None:
        # transformers gives chat_template.jinja priority over the copy in tokenizer_config.json.
        template_file = self.checkpoint_dir / "chat_template.jinja"
        if template_file.is_file():
            return template_file.read_text(encoding="utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {entry["name"]: entry["template"] for entry in template}
            if "default" not in named:
                raise LitsftError(
                    f"{self.checkpoint_dir}/tokenizer_config.json has chat templates {sorted(named)} but none "
                    "named 'default'; rename the one to use to 'default'"
                )
            template = named["default"]
        return template if isinstance(template, str) else None

    # ---- helpers ---------------------------------------------------------------------------------
    def _token_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._tokenizer.token_to_id(token)

    def _add_special(self, ids: list[int], add_bos: bool | None, add_eos: bool) -> list[int]:
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos:
            if self.bos_id is None:
                raise LitsftError(f"{self.checkpoint_dir} has no bos token; encode with add_bos=False")
            ids = [self.bos_id, *ids]
        if add_eos:
            ids = [*ids, self.eos_id]
        return ids


def read_tokenizer_file(path: Path) -> HFTokenizer:
    """A tokenizer.json, parsed; a damaged one is a LitsftError (`tokenizers` raises a bare Exception)."""
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as err:
        raise LitsftError(
            f"{path} is not a valid tokenizer.json ({first_line(err)}); copy it again from the original "
            "Hugging Face checkpoint"
        ) from None


def check_tokenizer_fits(tokens: int, vocab_size: int, where: Path, fix: str) -> None:
    """Refuse a tokenizer with ids at or past the model's embedding table, which would index out of range."""
    if tokens > vocab_size:
        raise LitsftError(
            f"the tokenizer {where} has {tokens} tokens but the model's vocab_size is {vocab_size}: its ids past "
            f"the embedding table would crash the model; {fix}"
        )


def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which some templates put around assistant replies for
    transformers' assistant mask: here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template. Preparing them once lets the renders of a
    conversation's prefixes (chat.py renders several) share the work."""
    # Like transformers: keys whose value is None are dropped, many templates print "None" otherwise. A
    # message without any is handed over as it is (the sandbox keeps templates from changing it).
    return [
        _with_reasoning_aliases(
            message
            if None not in message.values()
            else {key: value for key, value in message.items() if value is not None}
        )
        for message in messages
    ]


def render_template_messages(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    variables: dict[str, str],
    source: str,
    fix: str,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render a chat template the way transformers does, over messages prepared by `template_messages`.
    `source` names the template and `fix` says what to do instead, for the one-line error a broken template
    gives. `tools` are JSON schemas, passed as transformers' `apply_chat_template(tools=...)` passes them."""
    compiled = _compile_chat_template(template)
    # What Template.render does (a context over the template's globals and the variables, the output of
    # its root function joined), with the one dict built here instead of three (keyword arguments, render's
    # copy, new_context's merge with the globals): a render took 2.9 us, a third of it that overhead, and
    # tokenizing a conversation renders it 2 to 4 times. shared=True: the context reads this dict as it is.
    context = compiled.new_context(
        {
            **compiled.globals,
            **variables,
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        },
        shared=True,
    )
    try:
        return "".join(compiled.root_render_func(context))
    except jinja2.TemplateError as err:
        raise LitsftError(
            f"{source} failed on this conversation: {err}; fix the messages, or {fix}"
        ) from None


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning comes under, the one templates read (Qwen3, DeepSeek-R1) first."""


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its reasoning under `reasoning_content` (what most templates read) and `thinking`
    (what gpt-oss's reads), whichever name it came under, as transformers' apply_chat_template hands it
    (`_alias_reasoning_fields` in transformers/utils/chat_template_utils.py): a `thinking` or `reasoning`
    field would otherwise reach Qwen3's template as an empty <think></think>."""
    # A loop, not next() over a generator: this runs for every message of every record.
    for key in REASONING_FIELDS:
        reasoning = message.get(key)
        if reasoning is not None:
            break
    else:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> jinja2.Template:
    try:
        compiled = _chat_template_environment().from_string(template)
    except jinja2.TemplateError as err:
        raise LitsftError(
            f"a chat template does not compile: {err}; fix it or use a named prompt style"
        ) from None
    # Its globals as one dict instead of jinja's ChainMap over the environment's: each render copies them
    # into a new context, which from a ChainMap took about 40 us a render (a third of rendering a short
    # conversation). The environment is never changed after this.
    compiled.globals = dict(compiled.globals)
    return compiled


def _chat_template_environment() -> ImmutableSandboxedEnvironment:
    """A jinja environment configured like transformers' (utils/chat_template_utils.py), so templates
    render to the same text. Templates are untrusted: the sandbox keeps them off Python internals."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ):
        # jinja's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateNamespace(jinja2.utils.Namespace):
        # A namespace that refuses underscore-prefixed names, which lead towards Python internals.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r}")

    class TemplateDict:
        # `dict` without the class and its attributes, which lead towards Python internals.
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["namespace"] = TemplateNamespace
    environment.globals["dict"] = TemplateDict()
    return environment
