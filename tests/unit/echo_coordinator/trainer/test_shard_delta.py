"""The ranks of a sharded full-mode trainer choose each update's entries together
(`shard_delta.top_k`, two processes on gloo): the k largest values of all shards, ties to the
lowest ranks and indices first, as one process sorting the whole tensor would."""

import json
import os
import subprocess
import sys

import numpy as np

from echo_coordinator.trainer.distributed import free_port


def stable_top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest, ties lowest index first, ascending."""
    return np.sort(np.lexsort((np.arange(values.size), -values))[:k])


def test_two_ranks_choose_the_top_k_of_the_whole_tensor():
    rng = np.random.default_rng(0)
    cases = [  # (rank 0's shard, rank 1's shard, k)
        ([5, 3, 3, 1], [3, 3, 7, 0], 4),      # ties at the k-th value span both ranks: rank 0's go first
        ([5, 3, 3, 1], [3, 3, 7, 0], 3),      # one of four ties
        ([5, 3, 3, 1], [3, 3, 7, 0], 6),      # rank 0's two and rank 1's two
        ([0, 0, 0, 0], [0, 0, 0], 3),         # nothing moved: all tied at zero
        ([1e-30, 2.5e38, 0], [], 2),          # an empty shard (fewer rows than ranks); extreme values
        ([1, 2], [3, 4], 4),                  # k = every entry
    ]
    for size in (1000, 5000):  # many ties among small integers; distinct random magnitudes
        for values in (rng.integers(0, 6, size), np.abs(rng.standard_normal(size)) * 1e-3):
            cases.append((values[: size // 2 + 7].tolist(), values[size // 2 + 7:].tolist(), int(rng.integers(1, size))))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.top_k_rank"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo"))
             for r in range(2)]
    for r, p in enumerate(procs):  # (each rank reads all its input before it joins the other)
        p.stdin.write(json.dumps([{"k": k, "values": list(map(float, c[r]))} for *c, k in cases]))
        p.stdin.close()
    outs = [p.stdout.read() for p in procs]
    for p in procs:
        p.wait(timeout=120)
    assert [p.returncode for p in procs] == [0, 0]
    first, second = (json.loads(o) for o in outs)
    for (a, b, k), got0, got1 in zip(cases, first, second):
        whole = np.array(list(a) + list(b), dtype=np.float32)
        expected = stable_top_k(whole, k)
        got = got0["chosen"] + [len(a) + i for i in got1["chosen"]]
        assert got == expected.tolist(), (a, b, k)
        assert got0["counts"] == got1["counts"] == [len(got0["chosen"]), len(got1["chosen"])]
