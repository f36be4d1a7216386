"""An environment whose import has a side effect: it writes the file named by $ECHO_EVIL_MARKER.
A node must never import it because a coordinator named it (tests/adversarial/test_hostile_coordinator.py)."""

import os
from pathlib import Path

if os.environ.get("ECHO_EVIL_MARKER"):
    Path(os.environ["ECHO_EVIL_MARKER"]).write_text("imported")


class Env:
    pass
