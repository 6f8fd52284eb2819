"""How many characters of text one token can cover at most: what lets the router know,
without tokenizing, that a prompt cannot fit in a model's context.

Every token a tokenizer emits stands for one string of its vocabulary (or added tokens),
so a text of N characters needs at least N / L tokens, L the longest such string,
provided that nothing between the text and the vocabulary drops or merges characters.
That holds for the tokenizers real models ship (byte-level BPE; BPE or Unigram with byte
fallback, SentencePiece-style normalizers) and is checked here from `tokenizer.json`:

- the model must never emit an unknown token that covers several characters, nor drop
  one: BPE with byte fallback, or with `fuse_unk` off and an unknown token or the whole
  byte-level alphabet; Unigram with byte fallback. WordPiece and WordLevel map a whole
  word (any length) to `[UNK]`: no bound.
- the normalizer may only keep or grow the text (NFD/NFKD, Lowercase, Prepend, Replace
  of a literal), or compose it (NFC/NFKC: at most MAX_COMPOSED characters into one);
  anything else (Strip, BertNormalizer, Precompiled) may drop characters: no bound.
- the pre-tokenizer may only split (ByteLevel, Metaspace, Split and Punctuation unless
  they remove, Digits, UnicodeScripts); Whitespace and its kin drop the spaces: no bound.
- an added token that strips the whitespace around it covers any amount of it: no bound.

Byte-level vocabularies spell each byte as one character, so their lengths are in UTF-8
bytes, never fewer than the characters they cover. Pure: reads a parsed tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = ["MAX_COMPOSED", "max_chars_per_token"]

# NFC/NFKC compose at most this many characters into one (e.g. U+1F82 is four
# characters decomposed); tests/test_kv_limits.py checks it against unicodedata.
MAX_COMPOSED: Final = 4
_GROWING_NORMALIZERS: Final = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSING_NORMALIZERS: Final = frozenset({"NFC", "NFKC"})
_SPLITTING_PRE_TOKENIZERS: Final = frozenset({"ByteLevel", "Metaspace", "Digits",
                                              "UnicodeScripts"})


def max_chars_per_token(config: Mapping[str, Any], vocab: Iterable[str],
                        byte_alphabet: frozenset[str]) -> int | None:
    """Characters of text one token covers at most (after what the normalizer may
    compose), or None when this tokenizer can drop or merge characters. `vocab`: every
    token string (model vocabulary and added tokens); `byte_alphabet`: the 256
    characters a byte-level vocabulary spells bytes with."""
    tokens = list(vocab)
    if not tokens:
        return None
    pre = _types(config.get("pre_tokenizer"), "pretokenizers")
    if pre is None or not _model_covers(config.get("model"), "ByteLevel" in pre,
                                        set(tokens), byte_alphabet):
        return None
    shrink = _normalizer_shrink(config.get("normalizer"))
    if shrink is None:
        return None
    for added in config.get("added_tokens") or ():
        if not isinstance(added, dict) or added.get("lstrip") or added.get("rstrip"):
            return None  # it takes the whitespace around it along
    return max(len(t) for t in tokens) * shrink


def _types(component: Any, children: str) -> list[str] | None:
    """The pre-tokenizer's kinds (a Sequence's, flattened), or None if one drops text."""
    if component is None:
        return []
    if not isinstance(component, dict):
        return None
    kind = component.get("type")
    if kind == "Sequence":
        out: list[str] = []
        for child in component.get(children) or ():
            kinds = _types(child, children)
            if kinds is None:
                return None
            out += kinds
        return out
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return [kind]
    if kind in ("Split", "Punctuation") and component.get("behavior") != "Removed":
        return [kind]
    return None


def _model_covers(model: Any, byte_level: bool, vocab: set[str],
                  byte_alphabet: frozenset[str]) -> bool:
    """Whether the model emits one token per vocabulary string, never an unknown token
    that swallows several characters, and never drops a character."""
    if not isinstance(model, dict):
        return False
    if model.get("type") == "Unigram":
        return model.get("byte_fallback") is True
    if model.get("type") != "BPE":
        return False
    if model.get("byte_fallback") is True:
        return True  # an unknown character becomes its bytes' tokens
    if model.get("fuse_unk"):
        return False  # a run of unknown characters becomes one token
    return model.get("unk_token") is not None or (byte_level and byte_alphabet <= vocab)


def _normalizer_shrink(normalizer: Any) -> int | None:
    """How many characters of text the normalizer may turn into one (1: it never
    shrinks the text), or None when it may drop characters."""
    if normalizer is None:
        return 1
    if not isinstance(normalizer, dict):
        return None
    kind = normalizer.get("type")
    if kind == "Sequence":
        shrink = 1
        for child in normalizer.get("normalizers") or ():
            factor = _normalizer_shrink(child)
            if factor is None:
                return None
            shrink *= factor
        return shrink
    if kind in _GROWING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_COMPOSED
    if kind == "Replace":
        pattern, content = normalizer.get("pattern"), normalizer.get("content")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(literal, str) and literal and isinstance(content, str) and content:
            return -(-len(literal) // len(content))  # at worst every match shrinks
    return None
