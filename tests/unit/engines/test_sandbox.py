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
        assert "could not be set up (no Landlock" in done.stdout + done.stderr  # it fails closed
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
def test_a_process_that_already_runs_another_thread_is_refused_not_left_unconfined(tmp_path):
    """Landlock confines only the thread that asks: a sibling started before it would stay free
    (and code that took over the confined one could take it over). The sandbox fails closed: it
    raises, naming the threads in the way and the opt-in, and the process reads nothing after."""
    code = textwrap.dedent("""
        import sys, threading, time
        from pathlib import Path
        from engines.sandbox import SandboxError, confine
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        try:
            print(confine([], []))
        except SandboxError as e:
            print(e)
            sys.exit(3)
        print(Path(sys.argv[1]).read_text())
    """)
    (tmp_path / "secret").write_text("not given")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "secret")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("the sandbox for llama.cpp could not be set up (1 other threads ran before it could "
                                  "be confined: python); --no-sandbox runs llama.cpp unconfined"), done.stdout
    assert "not given" not in done.stdout


IMPORT_PATH = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from engines.sandbox import confine

    home, node_dir, model = sys.argv[1:]
    # What `python -m` run from / puts first, a relative PYTHONPATH entry, and the volunteer's
    # home and node directory, as an editable install's .pth or their PYTHONPATH can add them.
    sys.path[:0] = ["/", "", ".", "lib", home, node_dir, str(Path(home).parent)]
    confine([Path(model)], [])

    def attempt(path):
        try:
            Path(path).read_bytes()
            return "ok"
        except OSError as e:
            return e.__class__.__name__

    print(json.dumps({"home secret": attempt(Path(home) / "id_ed25519"),
                      "node key": attempt(Path(node_dir) / "node.key"),
                      "beside home": attempt(Path(home).parent / "notes.txt"),
                      "model": attempt(model), "python": attempt(os.__file__)}))
""")


@pytest.mark.skipif(landlock_abi() < 1 if sys.platform.startswith("linux") else True, reason="needs Landlock")
def test_no_import_path_entry_opens_the_volunteers_files(tmp_path):
    """The probe runs `python -m` in the worker's directory, /, which puts / first on its import
    path; the sandbox used to grant reading beneath every entry, so the probe could read every
    file. Entries that are /, relative, the home or a working directory (or above them) are
    never granted (issue 55, point 3)."""
    home, node_dir = tmp_path / "home", tmp_path / "home" / "echo"
    node_dir.mkdir(parents=True)
    (home / "id_ed25519").write_text("the volunteer's key")
    (node_dir / "node.key").write_text("the node's key")
    (tmp_path / "notes.txt").write_text("beside the home, on the path as its parent")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    env = dict(os.environ, HOME=str(home), ECHO_NODE_CWD=str(node_dir))
    done = subprocess.run([sys.executable, "-c", IMPORT_PATH, str(home), str(node_dir), str(model)],
                          capture_output=True, text=True, timeout=60, cwd="/", env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["model"] == seen["python"] == "ok"
    assert seen["home secret"] == seen["node key"] == seen["beside home"] == "PermissionError", seen
