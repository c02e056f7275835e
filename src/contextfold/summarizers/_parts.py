"""Content parts as summarizers see them: text as it is, every other part as a placeholder.

A placeholder names the part's kind and keeps what identifies it — its URL,
its file id and name, or for inline data its media type, image dimensions
and size — so a summary can still say that an image or a file was there and
where to find it: ``[image: https://example.com/a.png]``, ``[image: inline
image/png, 640x480, 150 KB]``, ``[file: file-abc123 report.pdf]``. Inline
(base64) data itself never reaches a summarizer.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from typing import Any

from .._messages import Message
from .._tokens import ImagePart, image_of

__all__ = ["REASONING_PARTS", "Segment", "placeholder", "segments"]

REASONING_PARTS = frozenset({"thinking", "redacted_thinking", "reasoning"})
"""Part types holding a model's own reasoning: shown as a bare placeholder, never kept as a fact."""

_NAMING_KEYS = ("file_id", "id", "filename", "name", "title", "url", "file_url", "uri")

Segment = tuple[bool, str]
"""One piece of a message's content: ``(True, text)`` or ``(False, placeholder)``."""


def _size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{round(size / 1024)} KB"
    return f"{size / (1024 * 1024):.1f} MB"


def _decoded_size(data: str) -> int:
    data = data.strip()
    return max(0, len(data) * 3 // 4 - (len(data) - len(data.rstrip("="))))


def _inline(media_type: str | None, size: int | None, extra: str = "") -> str:
    shown = ["inline" + (f" {media_type}" if media_type else "")]
    if extra:
        shown.append(extra)
    if size is not None:
        shown.append(_size(size))
    return ", ".join(shown)


def _data_url(url: str) -> str:
    """``inline <media type>, <size>`` for a ``data:`` URL; the address itself for any other URL."""
    if not url.startswith("data:"):
        return url
    header, _, data = url.partition(",")
    media_type = header[5:].split(";", 1)[0] or None
    size = _decoded_size(data) if header.endswith(";base64") else len(data)
    return _inline(media_type, size)


def _image(image: ImagePart) -> str:
    if image.url is not None:
        return f"[image: {image.url}]"
    if image.file_id is not None:
        return f"[image: {image.file_id}]"
    if image.size_bytes is not None:
        dimensions = f"{image.width}x{image.height}" if image.width and image.height else ""
        return f"[image: {_inline(image.media_type, image.size_bytes, dimensions)}]"
    return "[image]"


def _names(value: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    for key in _NAMING_KEYS:
        item = value.get(key)
        if isinstance(item, str) and item and item not in found:
            found.append(_data_url(item) if key in ("url", "file_url", "uri") else item)
    return found


def _source(source: Mapping[str, Any]) -> tuple[list[str], str]:
    """What identifies an Anthropic-style ``source``: its URL or file id, or its inline type and size."""
    kind = source.get("type")
    media = source.get("media_type")
    media_type = media if isinstance(media, str) else None
    data = source.get("data")
    if kind == "base64" and isinstance(data, str):
        return [], _inline(media_type, _decoded_size(data))
    if kind == "text" and isinstance(data, str):
        return [], f"text, {len(data)} characters"
    return _names(source), ""


def _data(holder: Mapping[str, Any]) -> str:
    """``inline <type>, <size>`` for the inline data a part or its body holds, else ""."""
    data = holder.get("file_data", holder.get("data", holder.get("base64")))
    if not isinstance(data, str):
        return ""
    if data.startswith("data:"):
        return _data_url(data)
    media = holder.get("format", holder.get("media_type", holder.get("mime_type")))
    return _inline(media if isinstance(media, str) else None, _decoded_size(data))


def placeholder(part: Mapping[str, Any]) -> str:
    """The placeholder one non-text content part is shown as."""
    image = image_of(part)
    if image is not None:
        return _image(image)
    kind = part.get("type")
    label = str(kind) if isinstance(kind, str) and kind else "part"
    label = {"input_audio": "audio", "input_file": "file", "input_image": "image"}.get(label, label)
    if label in REASONING_PARTS:
        return f"[{label}]"
    names = _names(part)
    inline = _data(part)
    for key in ("file", "input_audio", "audio", "source", "document", str(kind)):
        inner = part.get(key)
        if isinstance(inner, Mapping):
            more, inline = _source(inner) if key == "source" else (_names(inner), _data(inner))
            names += [name for name in more if name not in names]
            break
    shown = ", ".join(piece for piece in (" ".join(names), inline) if piece)
    return f"[{label}: {shown}]" if shown else f"[{label}]"


def segments(message: Message) -> list[Segment]:
    """The message's content in order: its text parts, and a placeholder for every other part."""
    content = message.content
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [(True, content)]
    out: list[Segment] = []
    for part in content:
        if part.get("type") == "text":
            text = part.get("text")
            if isinstance(text, str) and text:
                out.append((True, text))
            continue
        try:
            out.append((False, placeholder(part)))
        except (binascii.Error, ValueError, TypeError):  # a malformed part is still shown as one
            out.append((False, f"[{part.get('type') or 'part'}]"))
    return out
