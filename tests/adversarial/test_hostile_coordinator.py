"""A malicious coordinator against a real node (`echo-node join` over real DHT and streams): it
signs what it likes, and the volunteer's machine must come to no harm. Each case ends the node
with a clear message and the exit code for it, having written, imported and read nothing the
coordinator chose."""

import asyncio
import os
import time

from protocols.messages import TaskSpec
from tests.support.hostile_coordinator import HostileCoordinator

GIB = 2**30


def test_sizes_a_coordinator_states_are_checked_before_a_byte_is_written(tmp_path):
    async def go():
        # More than this disk holds; and within the disk, but past the volunteer's own limit.
        async with HostileCoordinator(size=400 * GIB) as huge, HostileCoordinator(size=2 * GIB) as small:
            return await asyncio.gather(huge.join(tmp_path / "a"), small.join(tmp_path / "b", "--max-disk", "1"))

    (code, out), (limited_code, limited) = asyncio.run(go())
    assert code == 1 and "the base model needs 400.00 GiB" in out and "free on its disk" in out, out
    assert limited_code == 1 and "needs 2.00 GiB" in limited and "--max-disk 1.0 GiB" in limited, limited
    for node in ("a", "b"):
        models = tmp_path / node / "models"
        assert not models.exists() or list(models.iterdir()) == []


def test_a_coordinator_cannot_make_a_node_import_or_read_what_it_names(tmp_path):
    own = tmp_path / "base.gguf"  # --model: checked by its hash, so its bytes are the run's base
    own.write_bytes(b"not a model, and the node never loads it")
    from protocols.signing import sha256_file

    marker = tmp_path / "imported"
    os.environ["ECHO_EVIL_MARKER"] = str(marker)

    named = TaskSpec("tests.support.evil_env:Env", {}, max_turns=2)
    # A single-turn task dressed as multi-turn, with a path to read until memory runs out.
    reader = TaskSpec("math", {"dataset": "/dev/zero"}, max_turns=2)

    async def go():
        async with (HostileCoordinator(task=named, base_sha256=sha256_file(own)) as importer,
                    HostileCoordinator(task=reader, base_sha256=sha256_file(own)) as reading):
            return await asyncio.gather(importer.join(tmp_path / "a", "--model", str(own)),
                                        reading.join(tmp_path / "b", "--model", str(own)))

    try:
        (code, out), (read_code, read_out) = asyncio.run(go())
    finally:
        del os.environ["ECHO_EVIL_MARKER"]
    assert code == 3 and "--allow-task tests.support.evil_env:Env" in out, out
    assert read_code == 3 and "single-turn task 'math'" in read_out, read_out
    assert not marker.exists()


def test_prompt_ids_past_the_vocabulary_are_refused_and_the_node_goes_on(tmp_path, tiny_model):
    """llama.cpp would read past its embedding table: the node refuses each such lease before
    the model sees it, keeps asking, and leaves when the run ends."""
    from protocols.messages import NoWork, TaskLease
    from protocols.signing import sha256_file

    def lease(request):
        if len(coordinator.requests) > 3:
            return NoWork(latest_version=0, retry_after=0.0, finished=True)
        return TaskLease(lease_id=f"L{len(coordinator.requests)}", run_id="hostile", node_id=request.node_id,
                         seeds=(1,), prompts=((1, 2, 10**6),), version=0, expires_at=time.time() + 60)

    coordinator = HostileCoordinator(base_sha256=sha256_file(tiny_model), lease=lease)

    async def go():
        async with coordinator:
            return await coordinator.join(tmp_path / "node", "--model", str(tiny_model), "--verbose", timeout=120)

    code, out = asyncio.run(go())
    assert code == 0 and "the run is finished" in out, out
    assert out.count("outside this model's") == 3 and len(coordinator.requests) == 4, out
