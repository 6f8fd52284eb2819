"""A prompt surely over its model's context is refused before it costs anything: the
bound on what one token covers (router/kv/token_bound.py) holds for any text, and what
the router refuses (router/kv/limits.py) is only what the engine would refuse."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from standins_fleet import live_member
from test_kv_tokenizer import make_byte_level_tokenizer, make_hf_tokenizer

from router.kv.limits import ModelLimit, PromptLimits
from router.kv.publishers import Publishers
from router.kv.token_bound import MAX_COMPOSED
from router.kv.tokenizer import ByteTokenizer, HfTokenizer, load_tokenizer
from wire.protocol import Role


def sentencepiece_like(directory: Path) -> HfTokenizer:
    """BPE with byte fallback behind NFC, Prepend and Replace, as Llama-2-style
    tokenizers are (their unknown characters become byte tokens)."""
    from tokenizers import Tokenizer, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o")]
    for c in "▁helo":
        vocab.setdefault(c, len(vocab))
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.save(str(directory / "tokenizer.json"))
    loaded = load_tokenizer(str(directory))
    assert isinstance(loaded, HfTokenizer)
    return loaded


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> list[HfTokenizer]:
    byte_level = tmp_path_factory.mktemp("byte_level")
    make_byte_level_tokenizer(byte_level)
    tok = load_tokenizer(str(byte_level))
    assert isinstance(tok, HfTokenizer)
    return [tok, sentencepiece_like(tmp_path_factory.mktemp("sentencepiece"))]


def test_the_bounds_of_the_tokenizers_real_models_ship(tokenizers, tmp_path: Path) -> None:
    byte_level, sentencepiece = tokenizers
    assert byte_level.max_chars_per_token == 6  # "Ġhello", "Ġworld"
    assert sentencepiece.max_chars_per_token == 6 * MAX_COMPOSED  # "<0x00>", composed
    assert ByteTokenizer().max_chars_per_token == 1


@pytest.mark.parametrize("change", [
    {"pre_tokenizer": {"type": "Whitespace"}},  # drops the spaces
    {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
    {"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}},
    {"model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": {"[UNK]": 0},
               "continuing_subword_prefix": "##", "max_input_chars_per_word": 100}},
])
def test_no_bound_where_characters_may_vanish(tmp_path: Path, change: dict) -> None:
    make_byte_level_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    tok = load_tokenizer(str(tmp_path))
    assert tok is not None and tok.max_chars_per_token is None


def test_no_bound_for_a_word_level_tokenizer_or_a_stripping_added_token(
        tmp_path: Path) -> None:
    make_hf_tokenizer(tmp_path)  # WordLevel: any unknown word is one [UNK]
    word_level = load_tokenizer(str(tmp_path))
    assert word_level is not None and word_level.max_chars_per_token is None
    make_byte_level_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    config = json.loads(path.read_text())
    config["added_tokens"][0]["rstrip"] = True
    path.write_text(json.dumps(config))
    stripping = load_tokenizer(str(tmp_path))
    assert stripping is not None and stripping.max_chars_per_token is None


def test_composition_and_lowercase_hold_for_every_code_point() -> None:
    """MAX_COMPOSED: no character decomposes (NFC's, NFKC's inverse) into more; and
    lowercasing never empties a character."""
    for code in range(sys.maxunicode + 1):
        c = chr(code)
        assert len(unicodedata.normalize("NFD", c)) <= MAX_COMPOSED
        if unicodedata.normalize("NFKC", c) == c:
            assert len(unicodedata.normalize("NFKD", c)) <= MAX_COMPOSED
        assert c.lower()


@given(st.text(max_size=300) | st.text(alphabet="helo wrd\u0301\u1100\u1161", max_size=300))
def test_no_text_takes_fewer_tokens_than_the_bound(tokenizers, text: str) -> None:
    for tok in tokenizers:
        bound = tok.max_chars_per_token
        assert bound is not None
        assert len(tok.completion_ids(text)) * bound >= len(text)


def limits(context: int = 100, per_token: int = 2) -> PromptLimits:
    out = PromptLimits()
    out.update({"m": ModelLimit(context, per_token)})
    return out


def refused(limit: PromptLimits, **body: object) -> bool:
    """Refused as the endpoint the body is for: a chat when it has messages."""
    answer = limit.refusal(msgspec.json.encode({"model": "m", **body}),
                           chat="messages" in body)
    if answer is None:
        return False
    assert answer.status == 400
    assert json.loads(answer.body)["error"]["code"] == "context_length_exceeded"
    return True


def test_what_is_refused_is_surely_over_the_context() -> None:
    limit = limits()  # 100 tokens of at most 2 characters: 200 characters fit
    assert refused(limit, prompt="a" * 201) and not refused(limit, prompt="a" * 200)
    assert refused(limit, prompt=["a" * 201]) and not refused(limit, prompt=["a" * 201] * 2)
    assert refused(limit, prompt=[1] * 101) and not refused(limit, prompt=[1] * 100)
    assert not refused(limit, prompt=[1] * 150 + ["x"])  # not token ids: the engine says
    user = {"role": "user", "content": "a" * 101}
    assert refused(limit, messages=[user, user])
    assert refused(limit, messages=[user, {"role": "user", "content": [
        {"type": "text", "text": "a" * 100}]}])
    # An assistant turn may be dropped by the template; padding may be trimmed.
    assert not refused(limit, messages=[user, {**user, "role": "assistant"}])
    assert not refused(limit, messages=[user, {"role": "user", "content": " " * 300}])
    assert not refused(limit, model="other", prompt="a" * 500)  # no limit known
    assert not refused(limit, prompt="a" * 150, messages="x" * 500)  # malformed: not here
    # Each endpoint's engine reads its own field only.
    assert not refused(limit, prompt="a" * 500, messages=[{"role": "user", "content": "a"}])
    assert limit.refusal(msgspec.json.encode({"model": "m", "prompt": "a",
                                              "messages": [user, user]}), chat=False) is None
    assert limit.refusal(b"{" * 300, chat=False) is None  # not JSON: the usual path says
    assert PromptLimits().refusal(msgspec.json.encode({"model": "m", "prompt": "a" * 500}),
                                  chat=False) is None


def test_a_context_is_the_longest_any_member_takes_and_unknown_if_one_does_not_say():
    def member(member_id: str, length: int):
        m = live_member(member_id, Role.PREFILL, "http://127.0.0.1:1")
        spec = msgspec.structs.replace(m.record.spec, max_model_len=length)
        return msgspec.structs.replace(m, record=msgspec.structs.replace(m.record, spec=spec))

    publishers = Publishers()
    members = {"a": member("a", 4096), "b": member("b", 8192)}
    publishers.update(members)
    assert publishers.context_length("m") == 8192  # a liar saying 1 cannot lower it
    members["c"] = member("c", 0)
    publishers.update(members, ["c"])
    assert publishers.context_length("m") is None  # c may take any length
    del members["c"], members["b"]
    publishers.update(members, ["b", "c"])
    assert publishers.context_length("m") == 4096
    assert publishers.context_length("other") is None


@given(st.text(max_size=400) | st.text(alphabet="hello world", max_size=400),
       st.integers(min_value=1, max_value=120))
def test_a_refused_prompt_never_fits(tokenizers, text: str, context: int) -> None:
    """What the router refuses, the engine's own tokens would not fit either."""
    for tok in [ByteTokenizer(), *tokenizers]:
        assert tok.max_chars_per_token is not None
        limit = PromptLimits()
        limit.update({"m": ModelLimit(context, tok.max_chars_per_token)})
        if refused(limit, prompt=text):
            assert len(tok.completion_ids(text)) > context
        if refused(limit, messages=[{"role": "user", "content": text}]):
            assert len(tok.completion_ids(text.strip())) > context
