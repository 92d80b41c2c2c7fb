import json
from pathlib import Path

import pytest
from tiny_tokenizer import BOS_TOKEN, EOS_TOKEN, write_tiny_tokenizer
from transformers import AutoTokenizer

from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": " Five. "},
    {"role": "user", "content": "And the color of the sky, é ü?"},
]
TEXTS = [
    "Hello world, the quick cat reads 42 stories!",
    "  leading spaces and\nnew lines\t tabs",
    "<|im_start|>user\nhi<|im_end|>\n",
    "unicode: héllo wörld 你好 🙂",
    "",
]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tokenizer_dir(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    write_tiny_tokenizer(directory, chat_template=request.param)
    return directory


def test_tiny_tokenizer_loads_in_transformers(tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(hf) == 512
    assert hf.convert_ids_to_tokens([hf.bos_token_id, hf.eos_token_id]) == [BOS_TOKEN, EOS_TOKEN]
    assert hf.decode(hf.encode(TEXTS[0], add_special_tokens=False)) == TEXTS[0]


def test_tiny_tokenizer_is_deterministic(tmp_path):
    write_tiny_tokenizer(tmp_path / "a")
    write_tiny_tokenizer(tmp_path / "b")
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_chat_matches_transformers(tokenizer_dir, add_generation_prompt):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert Tokenizer(tokenizer_dir).render_chat(CONVERSATION, add_generation_prompt) == expected


def test_render_chat_without_system_message_matches_transformers(tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = CONVERSATION[1:3]
    assert Tokenizer(tokenizer_dir).render_chat(messages) == hf.apply_chat_template(messages, tokenize=False)


def test_render_chat_template_features_match_transformers(tmp_path):
    # namespace, loop controls, tojson, raise_exception and the {% generation %} tag, as Hub templates use them
    template = (
        "{%- set ns = namespace(turns=0) %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' %}{{ message | tojson }}\n{% continue %}{% endif %}"
        "{%- set ns.turns = ns.turns + 1 %}"
        "{%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "{%- if message['role'] == 'assistant' %}{% generation %}<{{ message['content'] }}>{% endgeneration %}"
        "{%- else %}[{{ message['content'] }}]{% endif %}"
        "{%- if ns.turns == 3 %}{% break %}{% endif %}"
        "{%- endfor %}{{ eos_token }}{{ ns.turns }}{{ dict(a=1) | tojson }}"
    )
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    rendered = Tokenizer(tmp_path).render_chat(CONVERSATION)
    assert rendered == hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered.endswith(f"{EOS_TOKEN}3" + '{"a": 1}')


def test_encode_and_decode_match_transformers(tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer = Tokenizer(tokenizer_dir)
    for text in TEXTS:
        assert tokenizer.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False)
        # The default follows the checkpoint: Llama 3 adds bos, ChatML (Qwen) does not.
        assert tokenizer.encode(text) == hf.encode(text, add_special_tokens=True)
        ids = tokenizer.encode(text, add_eos=True)
        assert ids[-1] == tokenizer.eos_id
        assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert tokenizer.encode_batch(TEXTS, add_eos=True) == [tokenizer.encode(t, add_eos=True) for t in TEXTS]


def test_special_token_ids_match_transformers(tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer = Tokenizer(tokenizer_dir)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert tokenizer.vocab_size == len(hf)
    end_of_turn = "<|im_end|>" if tokenizer_dir.name.startswith("chatml") else "<|eot_id|>"
    assert tokenizer.stop_ids == [hf.eos_token_id, hf.convert_tokens_to_ids(end_of_turn)]


def test_pad_falls_back_to_eos_and_add_bos_to_the_post_processor(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template="llama3")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["pad_token"], config["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.pad_id == tokenizer.eos_id == 1
    assert tokenizer.add_bos  # from tokenizer.json's TemplateProcessing
    assert tokenizer.encode("hi")[0] == tokenizer.bos_id == 0


def test_chat_template_sources(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template=None)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.chat_template is None
    with pytest.raises(LitsftError, match=r"has no chat template .* use a named prompt style instead"):
        tokenizer.render_chat(CONVERSATION)

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(tmp_path).render_chat(CONVERSATION) == "D"
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer(tmp_path).render_chat(CONVERSATION) == "4"

    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(LitsftError, match=r"chat templates \['tool_use'\] but none named 'default'"):
        Tokenizer(tmp_path)


def test_template_errors_are_litsft_errors(tmp_path):
    write_tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(LitsftError, match=r"failed on this conversation: user first; .*named prompt style"):
        tokenizer.render_chat(CONVERSATION)
    broken = Tokenizer(tmp_path)
    broken.chat_template = "{% for message in messages %}"
    with pytest.raises(LitsftError, match="does not compile"):
        broken.render_chat(CONVERSATION)
    sandboxed = Tokenizer(tmp_path)
    sandboxed.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(LitsftError, match="failed on this conversation"):
        sandboxed.render_chat(CONVERSATION)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(LitsftError, match=r"tokenizer.json is missing; copy tokenizer.json"):
        Tokenizer(tmp_path)


def test_damaged_tokenizer_json_is_one_line(tmp_path):
    write_tiny_tokenizer(tmp_path)
    text = (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(LitsftError) as err:
        Tokenizer(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'tokenizer.json'} is not a valid tokenizer.json (")
    assert message.endswith("); copy it again from the original Hugging Face checkpoint")
    assert "\n" not in message
