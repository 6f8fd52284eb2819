"""A prompt's token ids, as the engine will see them: what the KV index is matched with.

One tokenizer per model, found (in this order) from `--tokenizer MODEL=PATH`, then from
what the model's members register (`KvEventsSpec.tokenizer`: a local directory, a file,
or a hub name present in the local Hugging Face cache; `pdreg:bytes` for the reference
engine). Nothing is downloaded. A model whose tokenizer cannot be found is not matched
exactly: the `kv` policy falls back to approximate prefix affinity for it and says so.

What is exact, and what is not:
- `prompt` as token ids (the client sent them): exact, whatever the model.
- `prompt` as text: the `tokenizers` library with the model's `tokenizer.json`, special
  tokens added as vLLM adds them for completions.
- `messages`: the model's chat template (`tokenizer_config.json`'s `chat_template`,
  rendered with Jinja2 as transformers does, `add_generation_prompt`), then encoded
  without adding special tokens (the template has them), as vLLM does. Extra template
  inputs (tools, documents) are not rendered: such requests are not matched (None).
- Anything else (several prompts, images): None, so the policy falls back.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from router.kv.token_bound import max_chars_per_token

__all__ = ["BYTES_TOKENIZER", "ByteTokenizer", "HfTokenizer", "PromptTokenizer",
           "TokenizerSet", "load_tokenizer", "parse_tokenizer_flags"]

logger = logging.getLogger(__name__)

BYTES_TOKENIZER: Final = "pdreg:bytes"  # the reference engine's: BOS + UTF-8 bytes
_BYTES_BOS: Final = 256
MAX_TOKENIZE_CHARS: Final = 4 * 1024 * 1024  # longer prompts are not matched


class PromptTokenizer(Protocol):
    name: str
    # Characters one token covers at most (router/kv/token_bound.py); None: no bound.
    max_chars_per_token: int | None

    def completion_ids(self, prompt: str) -> Sequence[int]: ...
    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> Sequence[int] | None: ...


def message_text(message: Mapping[str, Any]) -> str | None:
    """A message's text: a string, or the text parts of a list (None: other parts)."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            return None  # an image or audio part changes the engine's tokens
        texts.append(str(part.get("text", "")))
    return "".join(texts)


class ByteTokenizer:
    """The reference engine's tokenizer and chat template (engine_agent/reference/tokens).

    Its ids come as an `array("I")` built in C (each UTF-8 byte spread into a uint32
    by one strided copy): a list of ints costs ~15 ns per token to build and as much
    again to turn into the bytes the block keys hash (router/kv/keys.py copies an
    array of the same type with one memcpy), which was most of keying a long prompt."""

    name = BYTES_TOKENIZER
    max_chars_per_token: int | None = 1  # a token per UTF-8 byte: at most one character

    def completion_ids(self, prompt: str) -> Sequence[int]:
        data = prompt.encode("utf-8")
        spread = bytearray(4 * (len(data) + 1))
        spread[0:4] = _BYTES_BOS.to_bytes(4, "little")
        spread[4::4] = data
        ids = array("I", spread)
        if sys.byteorder != "little":
            ids.byteswap()
        return ids

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> Sequence[int] | None:
        parts = []
        for m in messages:
            text = message_text(m)
            role = m.get("role")
            if text is None or not isinstance(role, str):
                return None
            parts.append(f"<|{role}|>\n{text}\n")
        parts.append("<|assistant|>\n")
        return self.completion_ids("".join(parts))


class HfTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library) and its chat template."""

    def __init__(self, name: str, directory: Path) -> None:
        from tokenizers import Tokenizer, pre_tokenizers  # the kv policy's dependency

        self.name = name
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.max_chars_per_token = max_chars_per_token(
            json.loads((directory / "tokenizer.json").read_bytes()),
            self._tok.get_vocab(with_added_tokens=True),
            frozenset(pre_tokenizers.ByteLevel.alphabet()))
        self._template: Callable[..., str] | None = None
        self._specials: dict[str, str] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
            template = config.get("chat_template")
            for key in ("bos_token", "eos_token"):
                value = config.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    self._specials[key] = value
            if isinstance(template, str):
                self._template = _compile_template(template)

    def completion_ids(self, prompt: str) -> Sequence[int]:
        return self._encode(prompt, add_special_tokens=True)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> Sequence[int] | None:
        if self._template is None:
            return None
        try:
            text = self._template(messages=list(messages), add_generation_prompt=True,
                                  **self._specials)
        except Exception:  # a template that needs inputs we do not pass: not exact
            logger.debug("[tokenizer] %s: chat template failed", self.name, exc_info=True)
            return None
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # `encode_batch` runs with the GIL released (`encode` holds it): a long prompt
        # tokenized in a worker thread then leaves the event loop free to run.
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)


def _compile_template(source: str) -> Callable[..., str]:
    """Render like transformers: sandboxed Jinja2, trimmed blocks, `raise_exception`."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render


def _hub_snapshot(name: str) -> Path | None:
    """A hub model already in the local cache (HF_HUB_CACHE / HF_HOME); never downloads."""
    if "/" not in name or name.startswith(("/", ".")):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    snapshots = Path(hub) / ("models--" + name.replace("/", "--")) / "snapshots"
    if not snapshots.is_dir():
        return None
    for snapshot in sorted(snapshots.iterdir()):
        if (snapshot / "tokenizer.json").exists():
            return snapshot
    return None


def load_tokenizer(source: str) -> PromptTokenizer | None:
    """The tokenizer `source` names, or None (logged) if it is not here."""
    if source == BYTES_TOKENIZER:
        return ByteTokenizer()
    path = Path(source)
    directory = path.parent if path.name == "tokenizer.json" else path
    if not (directory / "tokenizer.json").exists():
        directory = _hub_snapshot(source) or directory
    if not (directory / "tokenizer.json").exists():
        logger.warning("[tokenizer] no tokenizer.json for %r here: matching for its model "
                       "falls back to approximate affinity (--tokenizer MODEL=PATH)", source)
        return None
    try:
        return HfTokenizer(source, directory)
    except Exception:
        logger.exception("[tokenizer] could not load %s", directory)
        return None


def parse_tokenizer_flags(values: Sequence[str]) -> dict[str, str]:
    """`--tokenizer MODEL=PATH`, repeatable."""
    out: dict[str, str] = {}
    for value in values:
        model, sep, source = value.partition("=")
        if not sep or not model or not source:
            raise ValueError(f"--tokenizer expects MODEL=PATH, got {value!r}")
        out[model] = source
    return out


class TokenizerSet:
    """One tokenizer per model, loaded once (a failure is remembered, not retried on
    every request; a member naming another source retries)."""

    def __init__(self, overrides: Mapping[str, str] | None = None,
                 loader: Callable[[str], PromptTokenizer | None] = load_tokenizer) -> None:
        self._overrides = dict(overrides or {})
        self._loader = loader
        self._loaded: dict[tuple[str, str], PromptTokenizer | None] = {}

    def get(self, model: str, registered: str = "") -> PromptTokenizer | None:
        source = self._overrides.get(model) or registered
        if not source:
            return None
        key = (model, source)
        if key not in self._loaded:
            self._loaded[key] = self._loader(source)
        return self._loaded[key]


def prompt_ids(tokenizer: PromptTokenizer | None, body: Mapping[str, Any]
               ) -> Sequence[int] | None:
    """The prompt's token ids as the engine will compute them, or None (not exact)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if prompt and all(type(t) is int and t >= 0 for t in prompt):
            return prompt  # the client's own token ids: exact for any model
        return None
    if tokenizer is None:
        return None
    if isinstance(prompt, str):
        if len(prompt) > MAX_TOKENIZE_CHARS:
            return None
        return tokenizer.completion_ids(prompt)
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        if any(k in body for k in ("tools", "documents")):
            return None
        return tokenizer.chat_ids(messages)
    return None
