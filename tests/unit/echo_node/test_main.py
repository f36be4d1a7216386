"""The process around the parts: exit codes, and `_serve`: a background task's failure ends the
node with its name, Ctrl-C ends it within STOP_SECONDS, and either way it says where it left."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from echo_node import main
from echo_node.config import JoinRefused, Stopped
from protocols.errors import EchoError
from protocols.supervise import BackgroundFailed
from tests.unit.echo_node.conftest import config
from tests.unit.protocols.factories import peer_id


@pytest.mark.parametrize("raised, code, said", [
    (None, 0, ""),
    (JoinRefused("wrong key"), 3, "refused to join: wrong key"),
    (Stopped("stopped while fetching the base model"), 0, "stopped while fetching the base model"),
    (EchoError("relay stopped: RuntimeError: no relay"), 1, "error: relay stopped"),
    (OSError("disk full"), 1, "error: disk full"),
])
def test_exit_codes(tmp_path, monkeypatch, capsys, raised, code, said):
    async def node(session):
        if raised is not None:
            raise raised

    monkeypatch.setattr(main, "live_node", node)
    assert main.run_node(config(tmp_path)) == code
    assert said in capsys.readouterr().out


class Presence:
    """Behind NAT (`relay_fails`): confirming the relay fails."""

    def __init__(self, relay_fails=None):
        self.relay_fails = relay_fails
        self.via_relay = f"/ip4/1.2.3.4/tcp/1/p2p/{peer_id('C')}" if relay_fails else None

    async def confirm_relay(self):
        await asyncio.sleep(0.05)
        raise self.relay_fails


class Work:
    """`slow`: ends 30 s after it is cancelled, like a call slow to notice."""

    def __init__(self, forever=True, slow=False):
        self.forever, self.slow, self.cancelled = forever, slow, False

    async def run(self):
        try:
            await asyncio.sleep(60 if self.forever else 0)
        except asyncio.CancelledError:
            self.cancelled = True
            if self.slow:
                await asyncio.sleep(30)
            raise


def test_a_background_failure_ends_the_node_with_its_name(session, capsys):
    work = Work()
    with pytest.raises(BackgroundFailed, match="relay stopped: RuntimeError: no relay"):
        asyncio.run(main._serve(session, Presence(relay_fails=RuntimeError("no relay")), SimpleNamespace(version=4), work))
    assert work.cancelled
    assert "left the run at version 4" in capsys.readouterr().out


def test_ctrl_c_ends_the_node_within_stop_seconds(session, monkeypatch, capsys):
    monkeypatch.setattr(main, "STOP_SECONDS", 0.2)
    presence, work = Presence(), Work(slow=True)

    async def go():
        asyncio.get_running_loop().call_later(0.1, session.request_stop)
        started = time.monotonic()
        await main._serve(session, presence, SimpleNamespace(version=2), work)
        return time.monotonic() - started  # the node leaves without the slow call

    assert asyncio.run(go()) < 5
    assert work.cancelled
    assert "left the run at version 2" in capsys.readouterr().out


def test_the_end_of_the_run_ends_the_node(session, capsys):
    asyncio.run(main._serve(session, Presence(), SimpleNamespace(version=9), Work(forever=False)))
    assert "left the run at version 9" in capsys.readouterr().out
