"""Confining the process that runs llama.cpp on files a coordinator chose (`engines.llama_worker`).

On Linux 5.13+ Landlock (an unprivileged kernel sandbox, no root, no namespaces) leaves it:
- reading only system and Python directories (/usr, /lib, /etc, /sys, the interpreter's prefix
  and import path) and the paths it is given (the node's model and adapters): not /proc, so what
  it needs there (the machine's memory, say) is read before `confine`;
- writing only beneath the directories it is given to write (full mode's re-exported weights)
  and /dev (a GPU is driven through its device files);
- no TCP connections or listening sockets (kernel ABI 4+), and no signals to, or abstract unix
  sockets of, processes outside the sandbox (ABI 6+).
Landlock also keeps it from tracing or reading the memory of the node that started it. On every
system it dumps no core and is the first process the kernel's OOM killer takes.

It fails closed on Linux: where it cannot confine (no Landlock in the kernel, or threads already
running), `confine` raises `SandboxError` and the process does not go on; running unconfined
takes the node's explicit `--no-sandbox`. Elsewhere (macOS) it says what is left out.

No import-path entry widens what it reads beyond Python's own files: an entry is granted only
when it is absolute and is neither `/`, the home directory, the working directory (the worker's,
and the node's, passed as `NODE_CWD`) nor a directory above one of them (`_grantable`). `python
-m` from `/` puts `/` first on the path, and a relative `PYTHONPATH` entry resolves from `/`.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
from pathlib import Path

# linux/landlock.h; the syscall numbers are those of the generic table (x86_64 and arm64 alike).
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_READ = _EXECUTE | _READ_FILE | _READ_DIR
_IOCTL_DEV = 1 << 15
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
# File access rights each ABI knows: 1: 13 rights, 2: +refer, 3: +truncate, 5: +ioctl on devices.
_FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
SYSTEM_READABLE = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/opt", "/sys")
OUR_PACKAGES = ("engines", "protocols", "tasks")  # what the worker (and a probe it starts) imports
# Not /proc: another process's environment and command line are readable there, and Landlock's
# rules on /proc entries do not last (they are lost when the kernel drops their dentries: seen).
NODE_CWD = "ECHO_NODE_CWD"  # the node's working directory, as its worker's environment tells it


class SandboxError(OSError):
    """A process that opens the coordinator's files could not be confined where it should be
    (Linux): it must not go on (`unconfinable` says why and what to do). An OSError, which
    `echo-node` prints and exits on: this module imports nothing that could start a thread."""


def unconfinable(why: str) -> SandboxError:
    return SandboxError(f"the sandbox for llama.cpp could not be set up ({why}); --no-sandbox runs llama.cpp "
                        f"unconfined, with your files within its reach (docs/volunteers.md)")


class _Ruleset(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def confine(readable: list[Path], writable: list[Path]) -> str:
    """Confine this process for good (see the module's docstring) and say how, for the node's
    console: `landlock ABI 7: ...` or what was left out and why."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash must not write the model's memory to disk
    if not sys.platform.startswith("linux"):
        return f"worker process only ({sys.platform} has no Landlock)"
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")  # out of memory: the worker goes, not the node
    except OSError:
        pass  # raising one's own score is always allowed; a /proc without it only loses this
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi < 1:
        raise unconfinable(f"no Landlock in this kernel: {os.strerror(ctypes.get_errno())}")
    # Landlock confines the calling thread (and those it starts later), not its siblings: a thread
    # started before would stay free, and code that takes over this one could take it over too.
    others = [t for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
    if others:
        names = ", ".join(sorted({Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in others}))
        raise unconfinable(f"{len(others)} other threads ran before it could be confined: {names}")
    fs = _FS_RIGHTS[max(k for k in _FS_RIGHTS if k <= abi)]
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = _Ruleset(fs, net, scoped)
    size = ctypes.sizeof(_Ruleset) if abi >= 6 else ctypes.sizeof(ctypes.c_uint64) * (2 if abi >= 4 else 1)
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path in _readable(readable):
            _allow(libc, ruleset, path, _READ)
        _allow(libc, ruleset, Path("/dev"), _READ | _WRITE_FILE | (_IOCTL_DEV & fs))
        for path in writable:
            _allow(libc, ruleset, path, fs)  # every right beneath it: files are written, renamed, removed
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    left_out = ([] if net else ["TCP"]) + ([] if scoped else ["signals"])
    return (f"landlock ABI {abi}: reads system and Python files and the model's, writes none of yours"
            + (f" ({' and '.join(left_out)} not confined by this kernel)" if left_out else ", no TCP"))


def _readable(given: list[Path]) -> list[Path]:
    """What the worker may read: the given paths, the system's, and the interpreter's (its
    libraries load lazily: a GPU backend's, numba's threading layer) where `_grantable`."""
    python = [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]
    # An editable install imports our packages through a finder, not a directory on sys.path.
    python += [os.path.dirname(sys.modules[name].__file__) for name in OUR_PACKAGES if name in sys.modules]
    return list(given) + [Path(p) for p in SYSTEM_READABLE] + [Path(p) for p in python if _grantable(p)]


def _grantable(entry: str) -> bool:
    """Whether an import-path entry may be read beneath: absolute, and not `/`, the home
    directory, a working directory (this process's, the node's) or a directory above one of them."""
    if not entry or not os.path.isabs(entry):
        return False
    path = os.path.realpath(entry)
    private = {os.path.expanduser("~"), os.getcwd(), os.environ.get(NODE_CWD, "")} - {""}
    return path != "/" and not any(p == path or p.startswith(path.rstrip("/") + "/")
                                   for p in map(os.path.realpath, private))


def _allow(libc, ruleset: int, path: Path, access: int) -> None:
    """Grant `access` beneath `path` (a file: the rights a file can have); a path that does not
    exist is skipped."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not path.is_dir():
            access &= _EXECUTE | _WRITE_FILE | _READ_FILE | (1 << 14)  # truncate; the rest are directory rights
        rule = _PathBeneath(access, fd)
        if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
