"""Prompt -> token ids for the kv policy: the reference engine's exact tokens, a Hugging
Face tokenizer.json with its chat template, client ids, and what is not matched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_agent.reference import tokens
from router.kv.tokenizer import (
    ByteTokenizer,
    TokenizerSet,
    load_tokenizer,
    parse_tokenizer_flags,
    prompt_ids,
)


def test_byte_tokenizer_is_the_reference_engines():
    t = ByteTokenizer()
    assert list(t.completion_ids("héllo")) == tokens.encode("héllo")
    assert list(t.completion_ids("")) == tokens.encode("")
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    want = tokens.encode(tokens.chat_prompt([("system", "be brief"), ("user", "hi")]))
    assert list(t.chat_ids(messages) or []) == want
    assert t.chat_ids([{"role": "user", "content": [{"type": "image_url"}]}]) is None


def make_hf_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4, "<|user|>": 5,
             "<|assistant|>": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))


def make_byte_level_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer.json, as real models ship (no unknown token, nothing
    dropped): its longest token, "Ġhello" or "Ġworld", covers 6 characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "hello"),
             ("w", "o"), ("r", "l"), ("wo", "rl"), ("worl", "d"), ("Ġ", "world")]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in words:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, words))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
    tok.save(str(directory / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))


def test_hf_tokenizer_and_chat_template(tmp_path: Path):
    make_hf_tokenizer(tmp_path)
    t = load_tokenizer(str(tmp_path))
    assert t is not None
    assert t.completion_ids("hello world") == [0, 3, 4]  # BOS added, as for completions
    # Chat: the template has the BOS; encoding adds no second one.
    assert t.chat_ids([{"role": "user", "content": "hello"}]) == [0, 5, 3, 6]
    assert load_tokenizer(str(tmp_path / "tokenizer.json")) is not None


def test_prompt_ids_shapes():
    t = ByteTokenizer()
    assert prompt_ids(None, {"prompt": [5, 6, 7]}) == [5, 6, 7]  # client ids: exact always
    assert prompt_ids(t, {"prompt": ["ab"]}) == t.completion_ids("ab")
    assert prompt_ids(t, {"prompt": ["a", "b"]}) is None  # several prompts
    assert prompt_ids(None, {"prompt": "ab"}) is None  # no tokenizer
    assert prompt_ids(t, {"messages": [{"role": "user", "content": "x"}],
                          "tools": []}) is None  # template inputs we do not render
    assert prompt_ids(t, {"prompt": [-1]}) is None


def test_sources_and_flags(tmp_path: Path):
    assert load_tokenizer(str(tmp_path / "nothing-here")) is None
    calls: list[str] = []

    def loader(source: str):
        calls.append(source)
        return ByteTokenizer() if source == "pdreg:bytes" else None

    s = TokenizerSet({"llama": "/models/llama"}, loader=loader)
    assert s.get("llama", "pdreg:bytes") is None  # the flag wins over what members say
    assert s.get("tiny", "pdreg:bytes") is not None
    assert s.get("tiny", "pdreg:bytes") is not None and calls.count("pdreg:bytes") == 1
    assert s.get("other") is None
    assert parse_tokenizer_flags(["a=b", "c=/d=e"]) == {"a": "b", "c": "/d=e"}
    with pytest.raises(ValueError):
        parse_tokenizer_flags(["nomodel"])
