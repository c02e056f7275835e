"""The ``contextfold`` command, and ``open_store(url)`` behind its store arguments.

The commands need the ``contextfold[cli]`` extra (click and rich); without it
the command prints the line that installs it and exits 1, and ``import
contextfold`` never imports either.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ._errors import ConfigError
from ._secrets import masked_url
from .stores._base import Store

__all__ = ["CLI_EXTRA_HINT", "main", "open_store", "redact_url"]

CLI_EXTRA_HINT = "the contextfold command needs its extra: pip install 'contextfold[cli]'"

_POSTGRES_SCHEMES = ("postgresql", "postgres")
_URL_FORMS = "sqlite:///PATH, a file path, or postgresql://USER@HOST/DB"
_DEFAULT_SCHEMA = "contextfold"  # PostgresStore's
_CONNECT_TIMEOUT_SECONDS = 10
_SQLITE_TABLES = frozenset({"threads", "messages", "episodes"})
"""Tables every schema version of a SQLite store holds."""


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***``, to print: ``postgresql://app:***@host/db``."""
    return masked_url(url)


def open_store(url: str, *, create: bool = True) -> Store:
    """The store a URL names: ``sqlite:///PATH`` or a plain path, or ``postgresql://...``.

    ``sqlite:///agent.db`` is relative to the working directory and
    ``sqlite:////var/agent.db`` absolute, as in SQLAlchemy. A PostgreSQL URL may
    carry ``?schema=NAME`` (default ``contextfold``); every other part goes to
    psycopg as it is. With ``create=False`` a store that does not exist is an
    error rather than a new, empty one: a SQLite file that is not there or holds
    no store (an empty file, another application's database), or a PostgreSQL
    schema that holds no store (checked over one blocking, read-only connection,
    as befits the command line). Errors show the URL with its password masked.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("url", f"must name a store: {_URL_FORMS}", value=url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in _POSTGRES_SCHEMES:
        return _postgres(url, create=create)
    if scheme == "sqlite":
        path = Path(url.split("://", 1)[1].removeprefix("/"))
        if not path.parts:
            raise ConfigError("url", f"names no file; use {_URL_FORMS}", value=redact_url(url))
    elif scheme:
        raise ConfigError(
            "url", f"has the unsupported scheme {scheme!r}; use {_URL_FORMS}", value=redact_url(url)
        )
    else:
        path = Path(url)
    if not create and not path.is_file():
        raise ConfigError(
            "url", "is not an existing SQLite file: pass the database a run wrote", value=str(path)
        )
    if not create:
        _require_sqlite_store(path, url)
    from .stores import SQLiteStore

    return SQLiteStore(path)


def _require_sqlite_store(path: Path, url: str) -> None:
    """Refuse a SQLite file that holds no store, reading it without changing it.

    Opening a ``SQLiteStore`` migrates the file, which would write contextfold's
    tables into whatever database it is. A file of a newer schema passes: the
    store names the version it does not understand.
    """
    what = None
    if path.stat().st_size == 0:
        what = "it is an empty file"
    else:
        try:
            conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5)
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                tables = {
                    row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                }
            finally:
                conn.close()
        except sqlite3.Error as exc:
            notadb = getattr(exc, "sqlite_errorname", "") == "SQLITE_NOTADB"
            what = "it is not a SQLite database" if notadb else f"it cannot be read ({exc})"
        else:
            if version < 1 or not _SQLITE_TABLES <= tables:
                what = "it is a SQLite database without contextfold's tables"
    if what is not None:
        raise ConfigError(
            "url",
            f"holds no contextfold store: {what}; pass the SQLite file a contextfold run wrote "
            "(only `contextfold demo` creates one)",
            value=redact_url(url),
        )


def _postgres(url: str, *, create: bool) -> Store:
    from .stores import PostgresStore

    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed "[" of an IPv6 host
        raise ConfigError(
            "url", f"is not a valid URL ({exc}); use {_URL_FORMS}", value=redact_url(url)
        ) from None
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [value for key, value in query if key == "schema"]
    dsn = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k != "schema"])))
    schema = schemas[-1] if schemas else _DEFAULT_SCHEMA
    store = PostgresStore(dsn, schema=schema)
    if not create:
        _require_schema(dsn, schema, url)
    return store


def _require_schema(dsn: str, schema: str, url: str) -> None:
    """Refuse a schema that holds no store, naming the schemas on the server that do."""
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=_CONNECT_TIMEOUT_SECONDS) as conn:
            found = conn.execute(
                "SELECT to_regclass(format('%%I.schema_version', %s::text)) IS NOT NULL, "
                "EXISTS (SELECT FROM pg_namespace WHERE nspname = %s)",
                (schema, schema),
            ).fetchone()
            if found is None or found[0]:
                return
            stores = [
                row[0]
                for row in conn.execute(
                    "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.relname = 'schema_version' AND c.relkind = 'r' "
                    "ORDER BY n.nspname <> %s, n.nspname LIMIT 6",
                    (_DEFAULT_SCHEMA,),
                )
            ]
    except psycopg.Error:
        return  # opening the store reports the server being unreachable, in its own words
    what = "holds no contextfold store" if found[1] else "does not exist"
    if stores:
        listed = ", ".join(stores[:5]) + (", ..." if len(stores) > 5 else "")
        where = f"schemas on this server that hold one: {listed}"
    else:
        where = "no schema on this server holds one yet; a run that writes to this URL creates it"
    raise ConfigError(
        "url",
        f"names no store: schema {schema!r} {what} (only a command that writes creates one); pass "
        f"?schema=NAME of a store a run wrote, or leave it out for {_DEFAULT_SCHEMA} ({where})",
        value=redact_url(url),
    )


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
