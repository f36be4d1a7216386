"""What every part shares: the retry wait says when the coordinator has been silent a while and
ends on a stop; `until_stopped` cancels the work in flight and waits for it only so long."""

import asyncio
import time

import pytest

from echo_node import session as session_module
from echo_node.config import Stopped
from protocols.errors import TransportError
from tests.unit.protocols.factories import peer_id


def test_a_silent_coordinator_is_reported_once_a_period(session, monkeypatch, capsys):
    monkeypatch.setattr(session_module, "UNREACHABLE_SAY", 10.0)
    error = TransportError("connection refused")
    asyncio.run(session.pause(error, 0.0))
    assert "cannot reach" not in capsys.readouterr().out  # it answered just now (the session's start)
    session.last_answer = time.monotonic() - 120
    asyncio.run(session.pause(error, 0.0))
    out = " ".join(capsys.readouterr().out.split())
    assert f"cannot reach the coordinator at /ip4/127.0.0.1/tcp/1/p2p/{peer_id('Coordinator')} for 2 min" in out
    assert "connection refused" in out and "still trying" in out
    asyncio.run(session.pause(error, 0.0))
    assert "cannot reach" not in capsys.readouterr().out  # not again within the period
    session.answered()
    session.said_unreachable = 0.0
    asyncio.run(session.pause(error, 0.0))
    assert "cannot reach" not in capsys.readouterr().out  # it answered again


def test_a_stop_ends_the_wait_and_pause_or_stop_says_so(session):
    async def go():
        asyncio.get_running_loop().call_later(0.05, session.request_stop)
        started = time.monotonic()
        with pytest.raises(Stopped):
            await session.pause_or_stop(TransportError("x"), 60.0)
        return time.monotonic() - started

    assert asyncio.run(go()) < 5
    assert session.stop_requested.is_set()  # the generation thread sees it too


def test_until_stopped_returns_the_result_or_cancels_within_the_grace(session):
    async def answer():
        return 42

    cancelled = []

    async def stubborn():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            await asyncio.sleep(30)  # like a call that takes its time to notice

    async def go():
        assert await session.until_stopped(answer()) == 42
        asyncio.get_running_loop().call_later(0.05, session.request_stop)
        started = time.monotonic()
        assert await session.until_stopped(stubborn(), grace=0.2) is None
        return time.monotonic() - started

    assert asyncio.run(go()) < 5 and cancelled == [True]
