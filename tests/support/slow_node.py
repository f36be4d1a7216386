"""`echo-node` whose pushes are held back by SLOW_NODE_DELAY seconds: a deliberately slow
volunteer, with every other code path the real node's."""

import asyncio
import os

from echo_node.work import Work

_push = Work._push


async def _slow_push(self, batch, expires_at):
    await asyncio.sleep(float(os.environ["SLOW_NODE_DELAY"]))
    return await _push(self, batch, expires_at)


Work._push = _slow_push

if __name__ == "__main__":
    from echo_node.cli import main

    main()
