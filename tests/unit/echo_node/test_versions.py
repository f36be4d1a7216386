"""Which version a node serves: it moves to each lease's version through the real catch-up, and a
failed move fails the round (the lease fixed the version)."""

import asyncio
import dataclasses
import tracemalloc

import numpy as np
import pytest

from echo_node.disk import DiskFull
from echo_node.presence import Presence
from echo_node.session import Session
from echo_node.updates import UpdateError
from echo_node.versions import Versions
from protocols.errors import RemoteError, TransportError
from protocols.transport.relay import Relay
from tests.unit.echo_node.conftest import Backend, RelayTrainer, config, full_run
from tests.unit.protocols import factories
from tests.unit.protocols.factories import peer_id


def versions_for(session, relay, manifest, base, *fail):
    presence = Presence(session)
    presence.endpoint = RelayTrainer(relay, *fail)
    ours = Versions(session, presence, peer_id("Trainer"), manifest, Backend(), {k: v.copy() for k, v in base.items()},
                    relay=Relay())
    return ours, presence


@pytest.mark.parametrize("mode", ["async", "sequential"])
def test_a_node_moves_to_the_lease_version_and_loads_it_once(session, mode):
    """Async too: the newest version whenever it can, not only when S behind."""
    base, relay, manifest, view = full_run(versions=3)
    versions, presence = versions_for(session, relay, dataclasses.replace(manifest, mode=mode), base)
    said = asyncio.run(versions.prepare(factories.lease(version=3)))
    assert versions.version == 3 and presence.endpoint.calls.count("echo.holders") == 3  # who holds each step's version
    assert said.startswith("updated to version 3 via delta 0->1 + delta 1->2 + delta 2->3")
    assert all(versions.master[k].tobytes() == view[k].tobytes() for k in view)  # the trainer's view, bit for bit
    # The backend is loaded once, after the whole chain, with the master weights of version 3.
    assert [v for v, _ in versions.backend.loads] == [3] and versions.loaded == 3
    assert np.array_equal(versions.backend.loads[0][1]["w"], view["w"])
    assert versions.relay.latest_version == 3  # and it serves what it verified to its peers
    assert asyncio.run(versions.prepare(factories.lease(version=3))) is None  # already there: nothing fetched


@pytest.mark.parametrize("mode, evaluation", [("async", False), ("sequential", False), ("async", True)])
def test_a_lease_is_sampled_at_its_version_or_not_at_all(session, mode, evaluation):
    """The lease fixes the version (`protocols.sync.lease_version`): a node whose update failed
    does not fall back to what it holds; it says so in its next lease request instead (`Work`),
    and then gets a lease of its own version, which needs no update."""
    base, relay, manifest, _ = full_run(versions=0)  # the trainer has nothing: every update fails
    versions, _ = versions_for(session, relay, dataclasses.replace(manifest, mode=mode, staleness=4), base)
    versions.version = versions.loaded = 3
    lease = factories.lease(version=5, evaluation=evaluation, samples=2 if evaluation else 0)
    with pytest.raises(UpdateError, match="update to version 5 stopped at version 3"):
        asyncio.run(versions.prepare(lease))
    assert asyncio.run(versions.prepare(factories.lease(version=3))) is None
    assert versions.version == 3 and versions.backend.loads == []


def test_an_evaluation_of_a_version_the_node_is_past_is_refused(session):
    base, relay, manifest, _ = full_run(versions=2)
    versions, presence = versions_for(session, relay, manifest, base)
    versions.version = 2
    with pytest.raises(UpdateError, match="evaluation of version 1, but this node holds version 2"):
        asyncio.run(versions.prepare(factories.lease(version=1, evaluation=True, samples=2)))
    assert presence.endpoint.calls == []


def test_a_busy_trainer_is_asked_again_soon_after_rereading_peers_and_other_failures_are_not(session):
    base, relay, manifest, _ = full_run(versions=1)
    busy = RemoteError("busy", "sent its share", peer_id("Trainer"), "echo.chunks")
    versions, presence = versions_for(session, relay, manifest, base, busy, busy)
    refreshed = []
    presence.refresh = lambda: refreshed.append(versions.version)
    asyncio.run(versions.bring_to(1))
    assert versions.version == 1 and refreshed == [0, 0]  # two busy answers, each followed by a re-read of peers
    # A failure that is not "busy" ends the move at once (the work loop retries with backoff).
    versions, presence = versions_for(session, relay, manifest, base, TransportError("stream broke"))
    with pytest.raises(UpdateError, match="stream broke|chunks unavailable"):
        asyncio.run(versions.bring_to(1))
    assert presence.endpoint.calls.count("echo.chunks") == 1


def test_a_chain_cut_short_keeps_and_loads_the_verified_prefix(session):
    base, relay, manifest, view = full_run(versions=3)
    last, _ = relay.updates[(2, 3)]
    relay.updates[(2, 3)] = (last, {})  # the trainer offers 2->3 but lost its chunks
    versions, presence = versions_for(session, relay, manifest, base)
    with pytest.raises(UpdateError, match="update to version 3 stopped at version 2"):
        asyncio.run(versions.bring_to(3))
    assert versions.version == 2
    assert [v for v, _ in versions.backend.loads] == [2]  # still serving: the backend holds version 2


def test_full_weights_make_room_for_their_float32_export_and_its_requantization_first(tmp_path):
    """Issue 36 point 6: full mode writes the master weights as a float32 GGUF, then requantizes
    them to a file as large as the base (an 8B base: ~32 GB, then ~5 GB). Room for both is made
    under --max-disk before either is written: a limit that cannot hold them refuses the load,
    with the room it needed; one that can loads them."""

    base, relay, manifest, _ = full_run(versions=1)
    need = 4 * sum(w.size for w in base.values()) + Backend().model_path.stat().st_size
    tight = Session(config(tmp_path / "tight", max_disk_gib=(need - 1) / 2**30))
    versions, _ = versions_for(tight, relay, manifest, base)
    with pytest.raises(DiskFull, match=f"version 1's weights needs {need / 2**30:.2f} GiB"):
        asyncio.run(versions.prepare(factories.lease(version=1)))
    assert versions.backend.loads == []
    roomy = Session(config(tmp_path / "roomy", max_disk_gib=(need + 2**20) / 2**30))
    versions, _ = versions_for(roomy, relay, manifest, base)
    asyncio.run(versions.prepare(factories.lease(version=1)))
    assert [v for v, _ in versions.backend.loads] == [1]


def test_a_late_full_mode_joiner_never_holds_the_base_beside_the_snapshot_that_replaces_it(tiny_model, session):
    """Issue 36 point 5: a node joining a full-mode run late catches up by a snapshot, which
    replaces every weight. It used to load the float32 base at join and decode the snapshot
    beside it (an 8B base: 32 GB of base, 32 GB of new weights and the snapshot's chunks at
    once). The base now loads only when a delta needs it: the snapshot is checked against the
    base's shapes (read from its checkpoint's header) and decoded alone. numpy reports its
    arrays to tracemalloc, so the peak counts every weight decoded or loaded."""
    from engines.hf import load_master
    from echo_coordinator.publish import Publisher
    from protocols.signing import generate_key, public_bytes

    _, base = load_master(tiny_model)
    weights_bytes = 4 * sum(w.size for w in base.values())
    key = generate_key()
    publisher = Publisher("run-1", key, "full", base, "dense-fp32", 1.0, snapshot_every=2, chunk_size=2**16)
    relay = Relay(keep_versions=100)
    rng, views = np.random.default_rng(0), {}
    for version in (1, 2, 3):
        moved = {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in base.items()}
        for update, store in publisher.publish(version, moved):
            relay.remember(update, store)
        views[version] = {k: v.copy() for k, v in publisher.view().items()}
    manifest = factories.manifest(run_key=public_bytes(key), update="full", mode="async", staleness=4)

    def node():
        backend = Backend()
        backend.model_path, backend.base_loads = tiny_model, 0

        def base_weights():
            backend.base_loads += 1
            return load_master(tiny_model)

        backend.base_weights = base_weights
        backend.load_weights = lambda master, version, workdir: backend.loads.append((version, master))  # no copy
        presence = Presence(session)
        presence.endpoint = RelayTrainer(relay)
        return Versions(session, presence, peer_id("Trainer"), manifest, backend, None, relay=Relay())

    late = node()
    tracemalloc.start()
    try:
        said = asyncio.run(late.prepare(factories.lease(version=2)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert said.startswith("updated to version 2 via snapshot 0->2")
    assert late.backend.base_loads == 0  # the base was never loaded
    assert peak < 1.5 * weights_bytes, f"peak {peak:,} B for {weights_bytes:,} B of weights"
    assert all(late.master[k].tobytes() == views[2][k].tobytes() for k in base)  # the trainer's view, bit for bit
    asyncio.run(late.prepare(factories.lease(version=3)))  # a delta applies to the snapshot's weights
    assert all(late.master[k].tobytes() == views[3][k].tobytes() for k in base) and late.backend.base_loads == 0
    assert [v for v, _ in late.backend.loads] == [2, 3]

    early = node()  # a node at version 0 whose first update is a delta loads the base for it, once
    said = asyncio.run(early.prepare(factories.lease(version=1)))
    assert said.startswith("updated to version 1 via delta 0->1") and early.backend.base_loads == 1
    assert all(early.master[k].tobytes() == views[1][k].tobytes() for k in base)
