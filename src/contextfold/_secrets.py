"""Connection URLs shown without their passwords: one reading of where a password is, for every message.

A password sits in a URL's user info (up to the netloc's last ``@``, as libpq
splits it, so a ``/``, ``?`` or ``#`` in the password is still masked) or in a
``password=`` option of the query or of a key=value connection string.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["MASK", "masked_url", "url_passwords"]

MASK = "***"

_URL_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*)://")
_PASSWORD_OPTION = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&]*)", re.IGNORECASE)
"""A ``password=`` option of a key=value DSN or a URL's query; an unclosed quote runs to the end."""


def _user_info(url: str) -> tuple[int, str] | None:
    """Where a URL's user info starts and the user info itself, when it holds a password."""
    match = _URL_SCHEME.match(url)
    if match is None:
        return None
    rest = url[match.end() :]
    at = rest.rfind("@")  # libpq takes the user info up to an '@'; the last one masks the most
    if at < 0 or ":" not in rest[:at]:
        return None
    return match.end(), rest[:at]


def masked_url(url: str) -> str:
    """``url`` with its password shown as ``***``: ``postgresql://app:***@host/db``."""
    found = _user_info(url)
    if found is not None:
        start, info = found
        url = f"{url[:start]}{info.split(':', 1)[0]}:{MASK}{url[start + len(info) :]}"
    return _PASSWORD_OPTION.sub(rf"\g<1>{MASK}", url)


def url_passwords(url: str) -> list[str]:
    """Every part of ``url`` that may be a password, as written, unquoted and percent-decoded."""
    found: list[str] = []
    info = _user_info(url)
    if info is not None:
        found.append(info[1].split(":", 1)[1])
    found += [option.group(2) for option in _PASSWORD_OPTION.finditer(url)]
    found += [value.strip("'") for value in found]
    found += [unquote(value) for value in found]
    return [value for value in set(found) if value]
