"""Issue 23 item 16, each over the real transport against a coordinator's service on 127.0.0.1
(tests/support/live_service.py): signatures good for their own kind of message only, holders
named only as the transport saw them, and the dashboard and `status` with what peers and other
processes can put in front of them (a foreign Host header, another run's API, markup in names)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.error
import urllib.request

import msgpack
import pytest
from typer.testing import CliRunner

from echo_coordinator import web
from echo_coordinator.cli import app
from echo_coordinator.observe import RunView
from echo_coordinator.report import read_report
from protocols import rpc
from protocols.errors import RemoteError
from protocols.messages import HoldersRequest, LeaseRequest, NoWork, RolloutBatch, TaskLease
from protocols.signing import canonical, generate_key, public_bytes, sign_message
from tests.support.live_service import LiveService, Peer
from tests.support.runs import stopped_run
from tests.unit.protocols.factories import peer_id

MARKUP = "[blink]mallory[/blink]"


def test_a_signature_made_for_other_bytes_than_this_kind_of_message_is_refused(tmp_path):
    """A lease request carrying the key's signature over its very fields, made without the
    protocol's domain and kind (as any other tool signing sorted msgpack would) or made for
    another kind of message, is refused as unsigned; the properly signed one is served."""
    async def go():
        async with LiveService(tmp_path) as coordinator:
            peer = await Peer.start(coordinator.address)
            try:
                key = generate_key()
                request = peer.lease_request(coordinator, key)
                body = {k: v for k, v in request.to_dict().items() if k != "signature"}
                answers = {}
                bare = msgpack.packb(dict(sorted(body.items())), use_bin_type=True)  # protocol 1's canonical bytes
                for name, signed, expected in (
                        ("the bare fields", lambda: key.sign(bare), "bad_signature"),
                        ("another kind", lambda: key.sign(canonical(body, NoWork.KIND)), "bad_signature"),
                        ("this kind", lambda: request.signature, "TaskLease")):
                    try:
                        raw = await peer.endpoint.call_one(
                            coordinator.peer, rpc.LEASE, dataclasses.replace(request, signature=signed()).to_wire())
                        answers[name] = type(raw).__name__
                    except RemoteError as e:
                        answers[name] = e.code
                    assert answers[name] == expected, answers
            finally:
                await peer.shutdown()

    asyncio.run(go())


def test_the_coordinator_names_as_holders_the_peers_that_spoke_for_their_keys_never_a_claimed_id(tmp_path):
    """Who holds a version (`echo.holders`) is learnt from lease requests, under the libp2p peer
    the transport saw them come from: a lease request naming another peer id (a victim to aim
    every node at, or no libp2p id at all: issue 36 point 1) names nobody but its sender. A
    version beyond the newest published is nobody's, and an asker is never named to itself."""
    async def go():
        async with LiveService(tmp_path) as coordinator:
            sender, asker = await Peer.many(coordinator.address, 2)
            try:
                key = generate_key()
                claim = sign_message(LeaseRequest(coordinator.manifest.run_id, public_bytes(key), peer_id("Victim"),
                                                  "claimant", 0, 64, time.time()), key)
                await sender.endpoint.call_one(coordinator.peer, rpc.LEASE, claim.to_wire())
                await coordinator.refreshed()

                async def named(peer, version):
                    return (await peer.endpoint.call_one(coordinator.peer, rpc.HOLDERS, HoldersRequest(version))).peers

                return (sender.peer_id, asker.peer_id, await named(asker, 0), await named(asker, 1),
                        await named(sender, 0), coordinator.presence.holding(0))
            finally:
                await sender.shutdown()
                await asker.shutdown()

    sender, asker, base, ahead, to_itself, counted = asyncio.run(go())
    assert base == (sender,) and ahead == () and to_itself == () and counted == 1


def get(url: str, host: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_dashboard_and_status_show_only_their_own_run_and_peer_names_as_text(tmp_path):
    """A running coordinator's dashboard on 127.0.0.1, a peer named in Rich markup that got a
    push refused over the real stream. A page elsewhere that points its own name at 127.0.0.1
    (DNS rebinding) sends its own Host: no answer. `status` shows the name as sent. And `status`
    of another run whose dashboard URL this dashboard now answers does not take it for its own."""
    run = tmp_path / "run"
    run.mkdir()

    async def go():
        async with LiveService(run) as coordinator:
            coordinator.ledger.set_run(run_id=coordinator.manifest.run_id, mode="sequential", version=0, steps=3,
                                       samples_per_step=4, staleness=1, model="tiny.gguf", task="arithmetic")
            peer = await Peer.start(coordinator.address)
            try:
                key = generate_key()
                lease = await peer.ask(coordinator, key, name=MARKUP)
                assert isinstance(lease, TaskLease)
                forged = sign_message(RolloutBatch(coordinator.manifest.run_id, "no-such-lease", 0, public_bytes(key),
                                                   (), created=time.time()), key)
                with pytest.raises(RemoteError):
                    await peer.endpoint.call_one(coordinator.peer, rpc.PUSH, forged.to_wire())
            finally:
                await peer.shutdown()
            sock = web.bind("127.0.0.1", 0)
            base = f"http://127.0.0.1:{sock.getsockname()[1]}/"
            (run / "dashboard.txt").write_text(base + "\n")
            dashboard = asyncio.create_task(web.serve(RunView(run, coordinator.ledger, live=coordinator.service.live),
                                                      sock))
            try:
                async with asyncio.timeout(15):
                    while (await asyncio.to_thread(get, base + "api/run"))[0] != 200:
                        await asyncio.sleep(0.1)
                rebound = await asyncio.to_thread(get, base + "api/peers", "evil.example")
                ours = await asyncio.to_thread(CliRunner().invoke, app, ["status", "--data-dir", str(run)],
                                               env={"COLUMNS": "200"})
                other = stopped_run(tmp_path / "other", base, steps=7)  # it served this port before
                theirs = await asyncio.to_thread(read_report, other)
                return rebound, ours, theirs
            finally:
                dashboard.cancel()
                await asyncio.gather(dashboard, return_exceptions=True)

    (code, body), ours, theirs = asyncio.run(go())
    assert code == 400 and b"mallory" not in body, (code, body[:200])
    assert ours.exit_code == 0, ours.output
    assert "(not running)" not in ours.output and MARKUP in ours.output, ours.output
    assert not theirs["live"] and theirs["run_id"] == "run-2" and theirs["progress"]["steps"] == 7, theirs
