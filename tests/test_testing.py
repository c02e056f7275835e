"""contextfold.testing's doubles, and the suite's own guards: the network and the event loop."""

from __future__ import annotations

import socket
import time

import anyio
import httpx
import pytest
from blockbuster import BlockingError

from contextfold import Message, ToolCall
from contextfold.testing import ScriptedModel, agent_session, replies, tool_step

# Taken at import, before any test's guard is in place.
UNGUARDED_GETADDRINFO = socket.getaddrinfo
NOWHERE = "192.0.2.1"  # TEST-NET-1: documentation only, routed nowhere

# pytest-socket warns as it refuses; here the refusal is the point.
refusals_expected = pytest.mark.filterwarnings("ignore:A test tried to use socket:UserWarning")


def refuses_a_local_non_loopback_address(method: str = "connect") -> None:
    """Fail at once, with nothing sent off the machine, unless the connect guard holds.

    0.0.0.0 is not a loopback address, so the guard refuses it; were the guard
    missing, the connection would go to this machine, not out of it.
    """
    with socket.socket() as probe:
        probe.settimeout(0.1)
        try:
            getattr(probe, method)(("0.0.0.0", 9))
        except RuntimeError:
            return
        except OSError:
            pass
    pytest.fail(f"the network guard let {method} to 0.0.0.0 through")


async def test_scripted_model_plays_replies_in_order_and_records_requests() -> None:
    """Each call returns the next scripted reply and keeps a copy of what it was sent."""
    model = ScriptedModel(replies("one", "two"))
    sent = [Message.user("hi")]
    assert (await model(sent)).text == "one"
    sent.append(Message.user("again"))
    assert (await model(sent)).text == "two"
    assert model.calls == 2
    assert [len(r) for r in model.requests] == [1, 2]


async def test_running_out_of_replies_says_how_many_there_were() -> None:
    """A call past the end of the script raises IndexError naming the script's length."""
    model = ScriptedModel(replies("only"))
    await model([])
    with pytest.raises(IndexError, match="after 1 calls"):
        await model([])


async def test_scripted_replies_must_come_from_the_assistant() -> None:
    """A scripted reply with another role is refused."""
    with pytest.raises(ValueError, match="assistant"):
        await ScriptedModel([Message.user("not me")])([])


async def test_stream_yields_text_in_chunks_then_tool_calls() -> None:
    """stream() splits the reply's text into chunk_size pieces and ends with its tool calls."""
    reply = tool_step("search", '{"q": "x"}', call_id="c1", text="abcdefghij")
    chunks = [c async for c in ScriptedModel([reply], chunk_size=4).stream([])]
    assert chunks[:3] == ["abcd", "efgh", "ij"]
    assert chunks[3] == ToolCall(id="c1", name="search", arguments='{"q": "x"}')


async def test_a_function_script_sees_the_request() -> None:
    """A function script decides each reply from the messages it is sent."""
    model = ScriptedModel(lambda messages: Message.assistant(f"{len(messages)} messages"))
    assert (await model([Message.user("a"), Message.user("b")])).text == "2 messages"


def test_agent_session_is_a_deterministic_tool_using_conversation() -> None:
    """agent_session gives the same messages for a seed, with tool results of 200-4,000 characters."""
    session = agent_session(400, seed=3)
    assert session == agent_session(400, seed=3) != agent_session(400, seed=4)
    assert len(session) == 400 and session[0].role.value == "system"
    outputs = [len(m.text) for m in session if m.role.value == "tool"]
    assert outputs and all(200 <= size <= 4_000 for size in outputs)
    calls = {c.id for m in session for c in m.tool_calls}
    assert {m.tool_call_id for m in session if m.role.value == "tool"} <= calls


@refusals_expected
def test_a_connection_beyond_loopback_fails_the_test() -> None:
    """Connecting to a non-loopback address raises before any packet leaves."""
    refuses_a_local_non_loopback_address()
    with pytest.raises(RuntimeError, match=NOWHERE):
        socket.create_connection((NOWHERE, 80), timeout=0.1)


@refusals_expected
def test_connect_ex_beyond_loopback_fails_too() -> None:
    """connect_ex, which pytest-socket leaves alone, refuses a non-loopback address as well."""
    refuses_a_local_non_loopback_address("connect_ex")
    with socket.socket() as sock, pytest.raises(RuntimeError, match="loopback"):
        sock.connect_ex((NOWHERE, 80))


@refusals_expected
def test_resolving_a_public_name_fails() -> None:
    """A DNS lookup of a provider's host is refused, so not even the resolver is asked."""
    assert socket.getaddrinfo is not UNGUARDED_GETADDRINFO, "the resolver guard is not installed"
    with pytest.raises(RuntimeError, match=r"api\.openai\.com"):
        socket.getaddrinfo("api.openai.com", 443)


@refusals_expected
async def test_an_http_client_cannot_reach_a_provider() -> None:
    """An httpx request to a public API fails the test instead of reaching it."""
    assert socket.getaddrinfo is not UNGUARDED_GETADDRINFO
    refuses_a_local_non_loopback_address()
    async with httpx.AsyncClient(timeout=1) as client:
        with pytest.raises(RuntimeError, match=r"api\.anthropic\.com"):
            await client.get("https://api.anthropic.com/v1/models")
        # anyio tries each address in a task group, so the refusal comes out grouped.
        with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match=NOWHERE)):
            await client.get(f"http://{NOWHERE}/")


async def test_loopback_connections_still_work() -> None:
    """A server on 127.0.0.1 is reachable by address and by the name localhost."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener:
        for host in ("127.0.0.1", "localhost"):
            async with await anyio.connect_tcp(host, port):
                pass


async def test_blocking_the_event_loop_from_contextfold_code_fails_the_test() -> None:
    """A blocking call made on the loop with contextfold's code on the stack raises BlockingError."""

    def sleepy(messages: list[Message]) -> Message:
        time.sleep(0.001)
        return Message.assistant("late")

    with pytest.raises(BlockingError, match=r"time\.sleep"):
        await ScriptedModel(sleepy)([])


async def test_the_same_call_in_a_worker_thread_is_allowed() -> None:
    """Blocking inside anyio.to_thread is what the detector asks for, so it passes."""

    def sleepy(messages: list[Message]) -> Message:
        time.sleep(0.001)
        return Message.assistant("on time")

    model = ScriptedModel(sleepy)
    reply = await anyio.to_thread.run_sync(lambda: model._next([]))
    assert reply.text == "on time"
