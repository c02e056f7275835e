"""Non-text content parts reach a model's prompt as placeholders that keep their URL or id."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from contextfold import Message
from contextfold.summarizers._parts import placeholder
from contextfold.summarizers._prompt import render_message, render_messages


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(buffer, "PNG")
    return buffer.getvalue()


RAW = png(640, 480) + b"\0" * 150_000  # trailing bytes pad it to ~150 KB; the header is what is read
INLINE = base64.b64encode(RAW).decode()
SHOWN = f"[image: inline image/png, 640x480, {round(len(RAW) / 1024)} KB]"
AUDIO = base64.b64encode(b"a" * 43_008).decode()
PDF = base64.b64encode(b"%PDF" * 300).decode()


@pytest.mark.parametrize(
    ("part", "shown"),
    [
        (
            {"type": "image_url", "image_url": {"url": "https://cdn.example.com/a.png"}},
            "[image: https://cdn.example.com/a.png]",
        ),
        (
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{INLINE}"}},
            SHOWN,
        ),
        (
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": INLINE}},
            SHOWN,
        ),
        (
            {"type": "image", "source": {"type": "url", "url": "https://x.org/b.jpg"}},
            "[image: https://x.org/b.jpg]",
        ),
        ({"type": "image", "source": {"type": "file", "file_id": "file_011CN"}}, "[image: file_011CN]"),
        ({"type": "input_image", "file_id": "file-img9"}, "[image: file-img9]"),
        (
            {"type": "file", "file": {"file_id": "file-abc123", "filename": "report.pdf"}},
            "[file: file-abc123 report.pdf]",
        ),
        ({"type": "input_file", "file_id": "file-9", "filename": "data.csv"}, "[file: file-9 data.csv]"),
        (
            {"type": "input_audio", "input_audio": {"data": AUDIO, "format": "wav"}},
            "[audio: inline wav, 42 KB]",
        ),
        (
            {
                "type": "document",
                "title": "Q3 report",
                "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
            },
            "[document: Q3 report, inline application/pdf, 1 KB]",
        ),
        (
            {"type": "document", "source": {"type": "url", "url": "https://x.org/spec.pdf"}},
            "[document: https://x.org/spec.pdf]",
        ),
        ({"type": "video_clip", "uri": "gs://bucket/clip.mp4"}, "[video_clip: gs://bucket/clip.mp4]"),
        ({"type": "thinking", "thinking": "secret chain", "signature": "sig"}, "[thinking]"),
        ({"type": "mystery"}, "[mystery]"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_every_part_shape_has_a_placeholder_keeping_what_identifies_it(
    part: dict[str, Any], shown: str
) -> None:
    """Images, files, audio, documents and unknown parts are named with their URL, id or inline size."""
    assert placeholder(part) == shown


def test_an_image_message_renders_its_text_and_its_placeholder_never_the_base64() -> None:
    """A user message with text and an inline image reaches the prompt as both, without its data."""
    message = Message(
        role="user",
        content=[
            {"type": "text", "text": "What does this chart show?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{INLINE}"}},
            {"type": "image_url", "image_url": {"url": "https://cdn.example.com/q3.png"}},
        ],
    )
    text = render_message(message)
    assert text == (f"user: What does this chart show?\n{SHOWN}\n[image: https://cdn.example.com/q3.png]")
    assert INLINE[:40] not in text


def test_a_tool_result_with_an_image_names_it() -> None:
    """An Anthropic-style tool result carrying a screenshot shows its placeholder under the call."""
    from contextfold import ToolCall

    call = Message.assistant(None, tool_calls=[ToolCall(id="t1", name="screenshot", arguments="{}")])
    result = Message(
        role="tool",
        tool_call_id="t1",
        content=[{"type": "image", "source": {"type": "url", "url": "https://shots.example.com/s1.png"}}],
    )
    assert "tool result (screenshot, call t1): [image: https://shots.example.com/s1.png]" in render_messages(
        [call, result]
    )


def test_long_text_is_cut_but_placeholders_are_kept_whole() -> None:
    """Cutting a long message to max_chars shortens its text parts and leaves every placeholder intact."""
    message = Message(
        role="user",
        content=[
            {"type": "text", "text": "a" * 5000},
            {"type": "file", "file": {"file_id": "file-keep-me", "filename": "notes.txt"}},
            {"type": "text", "text": "b" * 5000},
        ],
    )
    text = render_message(message, max_chars=1000)
    assert "[file: file-keep-me notes.txt]" in text
    assert "characters cut ...]" in text
    assert len(text) < 1400
