"""The ``contextfold`` command, and ``open_store(url)`` behind its store arguments.

The commands need the ``contextfold[cli]`` extra (click and rich); without it
the command prints the line that installs it and exits 1, and ``import
contextfold`` never imports either.
"""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ._errors import ConfigError
from .stores._base import Store

__all__ = ["CLI_EXTRA_HINT", "main", "open_store"]

CLI_EXTRA_HINT = "the contextfold command needs its extra: pip install 'contextfold[cli]'"

_POSTGRES_SCHEMES = ("postgresql", "postgres")
_URL_FORMS = "sqlite:///PATH, a file path, or postgresql://USER@HOST/DB"


def open_store(url: str, *, create: bool = True) -> Store:
    """The store a URL names: ``sqlite:///PATH`` or a plain path, or ``postgresql://...``.

    ``sqlite:///agent.db`` is relative to the working directory and
    ``sqlite:////var/agent.db`` absolute, as in SQLAlchemy. A PostgreSQL URL may
    carry ``?schema=NAME`` (default ``contextfold``); every other part goes to
    psycopg as it is. With ``create=False`` a SQLite file that does not exist is
    an error rather than a new, empty database.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("url", f"must name a store: {_URL_FORMS}", value=url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in _POSTGRES_SCHEMES:
        return _postgres(url)
    if scheme == "sqlite":
        path = Path(url.split("://", 1)[1].removeprefix("/"))
        if not path.parts:
            raise ConfigError("url", f"names no file; use {_URL_FORMS}", value=url)
    elif scheme:
        raise ConfigError("url", f"has the unsupported scheme {scheme!r}; use {_URL_FORMS}", value=url)
    else:
        path = Path(url)
    if not create and not path.is_file():
        raise ConfigError(
            "url", "is not an existing SQLite file: pass the database a run wrote", value=str(path)
        )
    from .stores import SQLiteStore

    return SQLiteStore(path)


def _postgres(url: str) -> Store:
    from .stores import PostgresStore

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [value for key, value in query if key == "schema"]
    dsn = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k != "schema"])))
    return PostgresStore(dsn, schema=schemas[-1]) if schemas else PostgresStore(dsn)


def main() -> None:
    """Run the command line; without the ``cli`` extra, say how to install it and exit 1."""
    try:
        from ._cli import app
    except ModuleNotFoundError as exc:
        if exc.name not in ("click", "rich"):
            raise
        print(CLI_EXTRA_HINT, file=sys.stderr)
        sys.exit(1)
    app()
