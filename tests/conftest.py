"""Shared fixtures and guards of the whole suite.

* ``postgres_url``: the PostgreSQL server the SQL tests use.
* Async tests run through anyio's pytest plugin (``anyio_mode = "auto"``):
  the conformance, compactor and loop suites on asyncio and trio, every other
  async test on asyncio.
* A blocking detector (blockbuster) is active for every async test: a blocking
  call made on the event loop with contextfold's code on the stack fails it.
* A network guard: connecting to, or resolving, anything but a loopback address
  fails the test (pytest-socket's ``--allow-hosts`` for ``connect``; the two
  holes it leaves, ``connect_ex`` and name resolution, are closed here).
"""

from __future__ import annotations

import inspect
import ipaddress
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from blockbuster import BlockBuster

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"

TESTS = Path(__file__).parent

# The suites that must hold on every backend anyio supports.
BOTH_BACKENDS = (TESTS / "conformance", TESTS / "test_compactor.py", TESTS / "test_loop.py")

# Tests known to fail on trio, by node id without the parameters, each with why.
# TODO(trio): remove each entry as the code it names is fixed.
TRIO_XFAIL: dict[str, str] = {}

# PostgresStore runs on asyncio only: psycopg's AsyncConnection and psycopg_pool wait
# on asyncio's loop. Its tests on trio are left out at collection (the README says so),
# not run to fail.
ASYNCIO_ONLY_BACKENDS = frozenset({"postgres"})


def _reachable(url: str) -> str | None:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 5432
    try:
        with socket.create_connection((host, port), timeout=2):
            return None
    except OSError as exc:
        return f"PostgreSQL at {host}:{port} is unreachable ({exc})"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The test server's URL; skips without one, except under CI where that fails."""
    url = os.environ.get("CONTEXTFOLD_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    problem = _reachable(url)
    if problem:
        hint = "set CONTEXTFOLD_TEST_POSTGRES_URL to a server you can reach"
        if os.environ.get("CI"):
            pytest.fail(f"{problem}; CI needs a real server: {hint}", pytrace=False)
        pytest.skip(f"{problem}; {hint}")
    yield url


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio, unless ``pytest_generate_tests`` parametrizes the test over both backends."""
    return "asyncio"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" not in metafunc.fixturenames:
        return
    path = Path(metafunc.definition.path)
    if any(path == root or root in path.parents for root in BOTH_BACKENDS):
        metafunc.parametrize("anyio_backend", ["asyncio", "trio"], scope="module")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("anyio_backend") != "trio":
            kept.append(item)
            continue
        if str(callspec.params.get("backend")) in ASYNCIO_ONLY_BACKENDS:
            left_out.append(item)
            continue
        reason = TRIO_XFAIL.get(item.nodeid.split("[", 1)[0])
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=False, reason=f"trio: {reason}"))
        kept.append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


def _blocking_detector() -> BlockBuster:
    """Blockbuster over contextfold's own code, with what may legitimately block on the loop."""
    # Only calls with a frame of src/contextfold on the stack count: a test's own
    # set-up (a raw sqlite3 check of the rows, a temporary file) is not the library
    # blocking the loop. Calls from worker threads never count: no loop runs there.
    detector = BlockBuster(scanned_modules=["contextfold"])
    functions = detector.functions
    # Blockbuster would replace socket.connect with a wrapper of the unguarded original,
    # silently undoing the network guard; a blocking connect still shows in send/recv.
    del functions["socket.socket.connect"]
    # Importing a module reads its files once, whatever it does while it loads (psycopg
    # probes for libpq); the stores import their drivers lazily, on first use.
    for function in functions.values():
        function.can_block_in("<frozen importlib._bootstrap>", {"_find_and_load"})
    # The summarizers' Breather calls time.sleep(0) to hand the GIL over; it never waits.
    functions["time.sleep"].can_block_in("contextfold/summarizers/_threads.py", {"__call__"})
    # SQLiteStore's point reads (state, stats, pressure) run one indexed SELECT on the
    # loop through a WAL reader with busy_timeout 0: it never waits for a lock, and
    # any busy answer falls back to the worker thread (see the module's docstring).
    for name in ("sqlite3.Connection.execute", "sqlite3.Cursor.fetchall"):
        functions[name].can_block_in("contextfold/stores/_sqlite.py", {"_point_row"})
    # With synchronous=NORMAL a step's small write (at most 64 KiB) runs there too, on
    # that connection, and so does a fold or replacement that removes at most 1,000 rows
    # (its count read with fetchone; a larger one rolls back and goes to the thread): no
    # commit syncs the disk (the worker thread's checkpoints do), and busy_timeout 0
    # answers at once when another process holds the write lock, falling back to the
    # worker thread as the reads do.
    writes = ("sqlite3.Connection.execute", "sqlite3.Connection.executemany", "sqlite3.Cursor.fetchall")
    for name in (*writes, "sqlite3.Cursor.fetchone"):
        functions[name].can_block_in("contextfold/stores/_sqlite.py", {"_write_on_loop"})
    return detector


_DETECTOR = _blocking_detector()


@pytest.fixture(autouse=True)
def blocking_detector(request: pytest.FixtureRequest) -> Iterator[None]:
    """Active for every async test, its async fixtures included (it is set up before them)."""
    function = getattr(request.node, "function", None)
    if function is None or not inspect.iscoroutinefunction(function):
        yield
        return
    _DETECTOR.activate()
    try:
        yield
    finally:
        _DETECTOR.deactivate()


class NetworkBlockedError(RuntimeError):
    """A test tried to reach, or to resolve, something other than this machine's loopback."""


def _is_loopback(host: object) -> bool:
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _is_numeric(host: object) -> bool:
    try:
        ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host))
    except ValueError:
        return False
    return True


@pytest.fixture(scope="session", autouse=True)
def network_guard() -> Iterator[None]:
    """Refuse name resolution and ``connect_ex`` beyond loopback for the whole session."""
    # pytest-socket guards socket.connect only; a DNS lookup of a provider's host
    # would still reach the resolver, and connect_ex would reach the host itself.
    real_getaddrinfo = socket.getaddrinfo
    real_connect_ex = socket.socket.connect_ex

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is None or host in ("", b"") or _is_loopback(host) or _is_numeric(host):
            return real_getaddrinfo(host, *args, **kwargs)
        raise NetworkBlockedError(
            f"a test tried to resolve {host!r}: tests reach only loopback (127.0.0.0/8, ::1, localhost); "
            "point the client at a server on 127.0.0.1"
        )

    def connect_ex(sock: socket.socket, address: Any) -> int:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise NetworkBlockedError(
                f"a test tried to connect to {address!r}: tests reach only loopback "
                "(127.0.0.0/8, ::1, localhost)"
            )
        return real_connect_ex(sock, address)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", getaddrinfo)
        patch.setattr(socket.socket, "connect_ex", connect_ex)
        yield
