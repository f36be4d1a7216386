"""Prints each package of a lock whose installed version differs from the lock's (usage: drift.py
LOCK), or that none does: what `make test-latest` runs on beyond what the suite last passed with."""

import importlib.metadata
import re
import sys


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


pins = (re.match(r"([\w.-]+)==(\S+)", line) for line in open(sys.argv[1]))
locked = {normal(m[1]): m[2] for m in pins if m}
installed = {normal(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
drift = [f"{name}: {version} in the lock, {installed.get(name, 'none')} here"
         for name, version in sorted(locked.items()) if installed.get(name) != version]
print("\n".join(drift) if drift else "every package is at the lock's version")
