"""The work loop: pushes overlap the next generation, a refusal is final, a broken stream is
retried while the lease lasts, and a key the run does not admit ends the node."""

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest

from echo_node.config import JoinRefused
from echo_node.join import Phases
from echo_node.schedule import set_paused
from echo_node.work import Work, check_lease
from protocols import rpc
from protocols.errors import InvalidValue, RemoteError, TransportError
from protocols.messages import LeaseRequest, NoWork, PushReceipt, RolloutBatch
from tests.unit.echo_node.conftest import Backend
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id


class Held:
    """Versions that already hold every lease's version (moving is test_versions' business)."""

    version = 0

    def __init__(self):
        self.finished_at = []

    async def prepare(self, lease):
        return None

    async def bring_to(self, version):
        self.finished_at.append(version)


class Recorder:
    """Generation that records when it started, into the trainer's event log; with `gate` (a
    threading.Event), held there until the test opens it."""

    def __init__(self, events, gate=None):
        self.events, self.gate = events, gate

    def generate(self, lease, version):
        self.events.append(("generate", lease.lease_id))
        if self.gate is not None:
            assert self.gate.wait(60), "the test never let the generation end"
        return factories.batch(lease_id=lease.lease_id, version=version)


def work_for(session, endpoint, events=None, gate=None) -> Work:
    return Work(session, endpoint, "trainer", factories.manifest(mode="async"), Backend(), Held(),
                Recorder(events if events is not None else [], gate), Phases())


class FlakyTrainer:
    """An endpoint whose pushes fail with the given errors, then succeed."""

    peer_id = peer_id("Node")

    def __init__(self, *errors):
        self.errors, self.calls = list(errors), 0

    async def call_one(self, peer, handler, request, idempotent=False):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return PushReceipt(accepted=4, rejected=0, reasons={}, latest_version=2)


def test_a_push_is_retried_across_a_broken_stream_but_not_after_a_refusal(session, monkeypatch):
    monkeypatch.setattr("protocols.supervise.Backoff.next", lambda self: 0.0)
    batch, lasts = factories.batch(), time.time() + 60
    work = work_for(session, FlakyTrainer(TransportError("stream broke"), TransportError("connection refused")))
    assert asyncio.run(work._push(batch, lasts)).accepted == 4 and work.endpoint.calls == 3
    # A refusal is the trainer's answer: pushing the same batch again is refused again (a node
    # that kept at it held a dead lease until it expired, and missed the end of the run).
    work = work_for(session, FlakyTrainer(RemoteError("stale", "batch of version 3 refused at version 6", "p", "echo.push")))
    with pytest.raises(RemoteError, match="stale"):
        asyncio.run(work._push(batch, lasts))
    assert work.endpoint.calls == 1
    # "busy" (the trainer judges other new keys' batches, or this peer's pushes are at their
    # limit) is no verdict: the same batch is pushed again while the lease lasts.
    work = work_for(session, FlakyTrainer(RemoteError("busy", "4 new keys' batches are being judged", "p", "echo.push")))
    assert asyncio.run(work._push(batch, lasts)).accepted == 4 and work.endpoint.calls == 2
    # A broken stream past the lease's expiry is given up.
    work = work_for(session, FlakyTrainer(TransportError("stream broke")))
    with pytest.raises(TransportError, match="stream broke"):
        asyncio.run(work._push(batch, time.time()))
    assert work.endpoint.calls == 1


def test_busy_is_pushed_again_at_a_short_interval_up_to_the_leases_end(session, monkeypatch):
    """Issue 37's flash crowd: a new key's push refused `busy` again and again. The backoff grows
    to 8 s and more, and the node gave up once the next try fell past the lease's expiry, with
    seconds of the lease left; now "busy" is asked again every PUSH_BUSY_RETRY seconds."""
    monkeypatch.setattr("protocols.supervise.Backoff.next", lambda self: 8.0)  # a grown backoff
    monkeypatch.setattr("echo_node.work.PUSH_BUSY_RETRY", 0.05)
    # The clock the node reads: its k-th push is made at 1000 + 0.05 (k - 1), however long this
    # machine took to make it (a loaded one took longer than the lease had left).
    monkeypatch.setattr("echo_node.work.time", SimpleNamespace(time=lambda: 1000 + 0.05 * (work.endpoint.calls - 1)))
    busy = [RemoteError("busy", "4 new keys' batches are being judged", "p", "echo.push") for _ in range(6)]
    work = work_for(session, FlakyTrainer(*busy))
    assert asyncio.run(work._push(factories.batch(), 1003.0)).accepted == 4 and work.endpoint.calls == 7
    work = work_for(session, FlakyTrainer(*busy))  # the lease's last moment: given up, not pushed past it
    with pytest.raises(RemoteError, match="busy"):
        asyncio.run(work._push(factories.batch(), 1000.12))
    assert work.endpoint.calls == 3  # at 0, 0.05 and 0.1 s; the next would fall past the lease's end


class SlowTrainer:
    """Hands out `leases` leases, then says the run is over; answers each push after `seconds`,
    or (None) once the node has started generating another lease or been told the run is over:
    a push that overlaps the next generation whatever either takes. Refuses the first push as
    stale. Records what happened when (the node's `Recorder` writes into `events` too), and the
    lease requests."""

    peer_id = peer_id("Node")

    def __init__(self, leases: int, seconds: float | None = None):
        self.left, self.seconds, self.events, self.pushing, self.most_pushing = leases, seconds, [], 0, 0
        self.requests: list[LeaseRequest] = []
        self.over = False  # the node was told the run is finished

    async def call_one(self, peer, handler, request, idempotent=False):
        if handler == rpc.LEASE:
            assert idempotent  # sent again if the stream breaks: the trainer answers it with the same lease
            self.requests.append(request)
            if self.left == 0:
                self.over = True
                return NoWork(latest_version=7, retry_after=0.0, finished=True)
            self.left -= 1
            return factories.lease(lease_id=f"L{self.left}", node_id=request.node_id, seeds=(1,), prompts=((1, 2),),
                                   version=0, expires_at=time.time() + 60)
        lease_id = RolloutBatch.from_wire(request).lease_id  # a push travels as its wire bytes
        self.pushing += 1
        self.most_pushing = max(self.most_pushing, self.pushing)
        if self.seconds is not None:
            await asyncio.sleep(self.seconds)
        else:
            while not (self.over or self.generated_after(lease_id)):
                await asyncio.sleep(0.01)
        self.pushing -= 1
        self.events.append(("answered", lease_id))
        if lease_id == "L2":
            raise RemoteError("stale", "batch of version 0 refused at version 4", "p", "echo.push")
        return PushReceipt(accepted=2, rejected=0, reasons={}, latest_version=0)

    def generated_after(self, lease_id: str) -> bool:
        """Whether the node started generating another lease after `lease_id`."""
        later = self.events[self.events.index(("generate", lease_id)) + 1:]
        return any(what == "generate" for what, _ in later)


def test_a_push_overlaps_the_next_generation_and_one_refusal_does_not_stop_the_node(session):
    trainer = SlowTrainer(leases=3)
    work = work_for(session, trainer, trainer.events)
    asyncio.run(asyncio.wait_for(work.run(), 60))
    # L1 is generated while L2's push is being answered, L0 while L1's; never two pushes at once.
    assert trainer.events == [("generate", "L2"), ("generate", "L1"), ("answered", "L2"), ("generate", "L0"),
                              ("answered", "L1"), ("answered", "L0")]
    assert trainer.most_pushing == 1
    assert work.accepted == 4  # L1 and L0; the refused L2 is only logged
    assert work.versions.finished_at == [7]  # the run ends once the last push is answered, at the final version
    # Until a rollout is accepted, a lease asks for one prompt's group (accepted sooner); then full leases.
    assert [r.max_seeds for r in trainer.requests] == [1, 1, 1, 64]
    assert {r.parallel for r in trainer.requests} == {8}  # the batch it decodes, for the lease size
    assert all(r.node_key == session.node_key and r.backend == "llama_cpp" for r in trainer.requests)


@pytest.mark.parametrize("bad, reason", [
    (dict(seeds=tuple(range(5)), prompts=((1,),) * 5), "5 seeds; we asked for at most 4"),
    (dict(node_id="someone-else"), "key someone-else"), (dict(run_id="run-2"), "for run run-2"),
    (dict(expires_at=1e12), "expires"), (dict(expires_at=-1e3), "expires"),
])
def test_a_lease_is_held_to_what_the_node_asked_for(bad, reason):
    """A coordinator's lease is checked like any remote input: a lease of 64 seeds to a node that
    asked for one, or expiring in a year (its push retried all that while, blocking the next),
    is refused; the round fails and is tried again."""
    asked, now = factories.lease_request(max_seeds=4), 1000.0
    good = factories.lease(node_id=asked.node_id, expires_at=now + 300)
    assert check_lease(good, asked, now) is good
    assert check_lease(dataclasses.replace(good, expires_at=now - 60), asked, now)  # clocks differ a little
    with pytest.raises(InvalidValue, match=reason):
        check_lease(dataclasses.replace(good, **bad), asked, now)


class Closed:
    """A trainer that admits only listed keys, answering `times` transient failures first."""

    peer_id = peer_id("Node")

    def __init__(self, times: int = 0):
        self.times, self.calls = times, 0

    async def call_one(self, peer, handler, request, idempotent=False):
        self.calls += 1
        if self.calls <= self.times:
            raise TransportError("connection refused")
        raise RemoteError("not_allowed", "key not listed", "p", "echo.lease")


def test_a_key_the_run_does_not_admit_ends_the_node_with_its_fingerprint(session, monkeypatch):
    monkeypatch.setattr("protocols.supervise.Backoff.next", lambda self: 0.0)
    work = work_for(session, Closed(times=2))
    with pytest.raises(JoinRefused, match=f"ask its operator to add {session.fingerprint}"):
        asyncio.run(work.run())
    assert work.endpoint.calls == 3  # two transient failures retried, the refusal not


def test_a_final_version_that_cannot_be_fetched_still_ends_the_run(session, capsys):
    work = work_for(session, SlowTrainer(leases=0, seconds=0))

    async def unreachable(version):
        raise TransportError("trainer gone")

    work.versions.bring_to = unreachable
    asyncio.run(work.run())
    assert "stays at version 0" in " ".join(capsys.readouterr().out.split())


def test_the_live_line_shows_version_lag_accepted_batch_and_throughput(tmp_path):
    from echo_node.session import Session
    from tests.unit.echo_node.conftest import config

    shown = []
    session = Session(config(tmp_path, name="carol"), status=SimpleNamespace(update=shown.append))
    work = work_for(session, SlowTrainer(leases=0, seconds=0))
    work.latest, work.accepted = 3, 16
    work.say("waiting for work")
    assert [str(line) for line in shown] == [
        "carol: version 0 (lag 3) · 16 samples accepted · batch 8 · 12 tok/s · waiting for work"]
    # A peer's text is shown as it is: rich markup in it is not read (it would make terminal links).
    work.say("lease [link=https://evil.example]L1[/link]")
    assert shown[-1].plain.endswith("lease [link=https://evil.example]L1[/link]") and not shown[-1].spans


class Behind:
    """An async trainer at version 2: a node behind that did not say its update failed is told
    the latest version (no work); one that did gets a lease of its own version. Then the run ends."""

    peer_id = peer_id("Node")

    def __init__(self):
        self.requests: list[LeaseRequest] = []

    async def call_one(self, peer, handler, request, idempotent=False):
        if handler == rpc.PUSH:
            return PushReceipt(accepted=2, rejected=0, reasons={}, latest_version=2)
        self.requests.append(request)
        if len(self.requests) > 2:
            return NoWork(latest_version=2, retry_after=0.0, finished=True)
        if request.version < 2 and not request.update_failed:
            return NoWork(latest_version=2, retry_after=30.0)  # never waited out: the node updates
        return factories.lease(lease_id="L", node_id=request.node_id, seeds=(1,), prompts=((1, 2),),
                               version=request.version, expires_at=time.time() + 60)


class Stuck(Held):
    """Versions whose every update fails."""

    async def bring_to(self, version):
        from echo_node.updates import UpdateError

        self.finished_at.append(version)
        raise UpdateError(f"update to version {version} stopped at version 0")


def test_a_node_behind_updates_between_leases_and_says_so_when_it_cannot(session):
    trainer, events = Behind(), []
    work = Work(session, trainer, "trainer", factories.manifest(mode="async"), Backend(), Stuck(), Recorder(events),
                Phases())
    asyncio.run(asyncio.wait_for(work.run(), 10))
    assert [(r.version, r.update_failed) for r in trainer.requests] == [(0, False), (0, True), (0, True)]
    assert events == [("generate", "L")]  # the lease of its own version, sampled as it was
    assert work.versions.finished_at[0] == 2  # it tried to update first, between leases


def test_a_paused_node_pushes_the_lease_in_hand_then_takes_no_other_until_resumed(session, monkeypatch):
    """`echo-node pause` while a lease is generated: that batch is still pushed and answered; no
    lease is asked for until `echo-node resume`."""
    monkeypatch.setattr("echo_node.work.IDLE_POLL", 0.05)
    trainer, generating = SlowTrainer(leases=2, seconds=0.1), threading.Event()
    work = work_for(session, trainer, trainer.events, gate=generating)
    data_dir, said, say = session.config.data_dir, [], work.say
    monkeypatch.setattr(work, "say", lambda event: (said.append(event), say(event)))

    async def scenario():
        running = asyncio.create_task(work.run())
        while ("generate", "L1") not in trainer.events:  # the first lease is being generated, held there
            await asyncio.sleep(0.01)
        set_paused(data_dir, True)
        generating.set()
        # Its push answered, and the node waiting in its pause (it said so) rather than asking.
        while ("answered", "L1") not in trainer.events or not any(e.startswith("paused") for e in said):
            await asyncio.sleep(0.01)
        paused_requests, paused_events = len(trainer.requests), list(trainer.events)
        set_paused(data_dir, False)
        await running
        return paused_requests, paused_events

    paused_requests, paused_events = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert paused_requests == 1  # nothing asked for while paused ...
    assert paused_events == [("generate", "L1"), ("answered", "L1")]  # ... but the lease in hand was delivered
    assert len(trainer.requests) == 3 and ("answered", "L0") in trainer.events  # and work went on once resumed


class BreaksOnce(Held):
    """Versions whose first move to a lease's version breaks off (a provider's stream broke)."""

    def __init__(self):
        super().__init__()
        self.tries = 0

    async def prepare(self, lease):
        from echo_node.updates import UpdateError

        self.tries += 1
        if self.tries == 1:
            raise UpdateError("update to version 19 stopped at version 18: 107 of 420 chunks unavailable")
        return None


def test_a_round_whose_update_broke_off_samples_the_same_lease_and_asks_for_no_other(session, monkeypatch):
    """The node used to drop the lease when one update attempt failed and ask for another: the
    dropped lease stayed held at the trainer with its seeds until it expired, and a sequential
    step waited 305 s on it (issue 55, point 13). The retried round samples the lease in hand."""
    monkeypatch.setattr("protocols.supervise.Backoff.next", lambda self: 0.0)
    trainer = SlowTrainer(leases=1, seconds=0.0)
    work = Work(session, trainer, "trainer", factories.manifest(mode="sequential"), Backend(), BreaksOnce(),
                Recorder(trainer.events), Phases())
    asyncio.run(asyncio.wait_for(work.run(), 30))
    assert work.versions.tries == 2
    assert trainer.events == [("generate", "L0"), ("answered", "L0")]
    assert len(trainer.requests) == 2  # the lease, then (its push answered) the run's end: no second lease
