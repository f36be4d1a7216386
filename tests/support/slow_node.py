"""`echo-node` whose pushes are held back: by SLOW_NODE_DELAY seconds, or until the run whose
`state.json` is SLOW_NODE_STATE names a version SLOW_NODE_VERSIONS past the batch's (at most
until the lease expires): a deliberately slow volunteer, with every other code path the real
node's. Held by versions, a batch is as stale as the test needs however fast either side runs."""

import asyncio
import json
import os
import time
from pathlib import Path

from echo_node.work import Work

_push = Work._push


def _run_version(state: Path) -> int:
    try:
        return json.loads(state.read_text())["version"]
    except (OSError, ValueError, KeyError):  # not written yet
        return -1


async def _slow_push(self, batch, expires_at):
    if state := os.environ.get("SLOW_NODE_STATE"):
        until = batch.version + int(os.environ["SLOW_NODE_VERSIONS"])
        while _run_version(Path(state)) < until and time.time() < expires_at:
            await asyncio.sleep(0.2)
    else:
        await asyncio.sleep(float(os.environ["SLOW_NODE_DELAY"]))
    return await _push(self, batch, expires_at)


Work._push = _slow_push

if __name__ == "__main__":
    from echo_node.cli import main

    main()
