"""What a process confined by `engines.sandbox` can still reach: run in a real child process, each
attempt made after `confine`, on this machine's kernel."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, os, socket, sys
    from pathlib import Path
    from engines.sandbox import confine

    allowed, writable, secret, port, parent = sys.argv[1:]
    how = confine([Path(allowed)], [Path(writable)])

    def attempt(action):
        try:
            action()
            return "ok"
        except OSError as e:
            return e.__class__.__name__

    print(json.dumps({
        "how": how,
        "read allowed": attempt(lambda: (Path(allowed) / "model.gguf").read_bytes()),
        "read secret": attempt(lambda: Path(secret).read_bytes()),
        "list home": attempt(lambda: os.listdir(Path(secret).parent)),
        "write writable": attempt(lambda: (Path(writable) / "v1.gguf").write_bytes(b"x")),
        "write allowed": attempt(lambda: (Path(allowed) / "evil").write_bytes(b"x")),
        "overwrite model": attempt(lambda: (Path(allowed) / "model.gguf").write_bytes(b"x")),
        "connect": attempt(lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=2)),
        "parent environ": attempt(lambda: Path(f"/proc/{parent}/environ").read_bytes()),
        "parent cmdline": attempt(lambda: Path(f"/proc/{parent}/cmdline").read_bytes()),
        "own environ": attempt(lambda: Path("/proc/self/environ").read_bytes()),
        "unix sockets": attempt(lambda: Path("/proc/net/unix").read_bytes()),  # where p2pd's socket is named
        "signal parent": attempt(lambda: os.kill(int(parent), 0)),
        "read python": attempt(lambda: Path(os.__file__).read_bytes()),
    }))
""")


def landlock_abi() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Landlock is Linux's")
def test_a_confined_process_reads_only_what_it_is_given_and_writes_and_dials_nothing(tmp_path):
    allowed, writable, home = tmp_path / "models", tmp_path / "weights", tmp_path / "home"
    for d in (allowed, writable, home):
        d.mkdir()
    (allowed / "model.gguf").write_bytes(b"GGUF")
    secret = home / "id_ed25519"
    secret.write_text("the volunteer's key")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        done = subprocess.run([sys.executable, "-c", PROBE, str(allowed), str(writable), str(secret),
                               str(listener.getsockname()[1]), str(os.getpid())],
                              capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    abi = landlock_abi()
    if abi < 1:
        assert seen["how"].startswith("worker process only (no Landlock")
        return
    assert seen["how"].startswith(f"landlock ABI {abi}")
    assert seen["read allowed"] == seen["write writable"] == seen["read python"] == "ok"
    for denied in ("read secret", "list home", "write allowed", "overwrite model", "parent environ", "parent cmdline",
                   "own environ", "unix sockets"):
        assert seen[denied] == "PermissionError", denied
    assert (allowed / "model.gguf").read_bytes() == b"GGUF" and not (allowed / "evil").exists()
    if abi >= 4:
        assert seen["connect"] == "PermissionError"
    if abi >= 6:
        assert seen["signal parent"] == "PermissionError"


@pytest.mark.skipif(landlock_abi() < 1 if sys.platform.startswith("linux") else True, reason="needs Landlock")
def test_a_process_that_already_runs_another_thread_says_it_is_not_confined(tmp_path):
    """Landlock confines only the thread that asks: a sibling started before it would stay free
    (and code that took over the confined one could take it over), so the process is not called
    confined, and it says which threads were in the way."""
    code = textwrap.dedent("""
        import sys, threading, time
        from pathlib import Path
        from engines.sandbox import confine
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        print(confine([], []))
        print(Path(sys.argv[1]).read_text())  # not given, read all the same: nothing was confined
    """)
    (tmp_path / "secret").write_text("not given")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "secret")], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.splitlines() == ["worker process only (1 other threads ran before it could be confined: python)",
                                        "not given"], done.stderr
