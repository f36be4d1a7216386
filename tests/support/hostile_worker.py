"""A stand-in for `engines.llama_worker` whose answers break the protocol as option `mode` says:
what a worker whose llama.cpp was subverted by a coordinator's file could send the node."""

import json
import sys
import time
from multiprocessing.connection import Connection

ANSWERS = {  # to a generate of one request of up to 4 tokens, in a vocabulary of 100 ids
    "id past the vocabulary": {"ok": {"completions": [[[100], [-1.0]]], "rate": 1.0}},
    "too many tokens": {"ok": {"completions": [[[1] * 5, [-1.0] * 5]], "rate": 1.0}},
    "nan logprob": {"ok": {"completions": [[[1], [float("nan")]]], "rate": 1.0}},
    "positive logprob": {"ok": {"completions": [[[1], [3.0]]], "rate": 1.0}},
    "bool for an id": {"ok": {"completions": [[[True], [-1.0]]], "rate": 1.0}},
    "lengths differ": {"ok": {"completions": [[[1, 2], [-1.0]]], "rate": 1.0}},
    "one completion too many": {"ok": {"completions": [[[1], [-1.0]], [[1], [-1.0]]], "rate": 1.0}},
    "a list for an answer": [1, 2, 3],
    "a follow for no sequence": {"follow": 7, "completion": [[1], [-1.0]]},
}


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    options = json.loads(conn.recv_bytes())
    conn.send_bytes(json.dumps({"ok": {"hardware": "hostile \x1b]52;c;ZWNobyBldmls\x07", "eos": 2, "vocab_size": 100, "parallel": 1,
                                       "n_params": 1000, "fitted": None, "confined": None}}).encode())
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except EOFError:
            return
        if message["op"] == "tokenize":
            conn.send_bytes(json.dumps({"error": "\x1b[2Jrefused", "kind": "value"}).encode())
        elif message["op"] != "generate":
            conn.send_bytes(json.dumps({"ok": None}).encode())
        elif options["mode"] == "not json":
            conn.send_bytes(b"\x80\x04 not json")
        elif options["mode"] == "runaway memory":  # a parser bug allocating without end, 64 MiB at a time
            held = []
            while True:
                held.append(b"x" * 2**26)
                time.sleep(0.01)
        else:
            conn.send_bytes(json.dumps(ANSWERS[options["mode"]]).encode())


if __name__ == "__main__":
    main()
