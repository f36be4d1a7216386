"""When a volunteer's machine works for the run: `--hours 22-07` (local time), and `echo-node pause`
/ `resume` on a running node. Outside its hours or while paused, a node takes no new lease: the
lease in hand is finished and pushed (its work is not thrown away), then the node waits, and takes leases again when the hours begin or it is resumed.

`pause` and `resume` reach a running node through a file in its data dir, which the node looks
for before each lease: no socket to open, and it works for a node started in another terminal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

PAUSE_FILE = "paused"  # in the data dir: present while `echo-node pause` holds
_HOURS = re.compile(r"^(\d{1,2})(?::(\d{2}))?-(\d{1,2})(?::(\d{2}))?$")


@dataclass(frozen=True)
class Hours:
    """The hours a node works, minutes since midnight; `start` > `end` wraps past midnight."""

    start: int
    end: int

    @classmethod
    def parse(cls, text: str) -> Hours:
        """`22-07`, `9:30-17:00`: start and end hours, local time."""
        m = _HOURS.match(text.strip())
        if m is None:
            raise ValueError(f"--hours must be START-END in local time, like 22-07 or 9:30-17:00; got {text!r}")
        h1, m1, h2, m2 = (int(g or 0) for g in m.groups())
        if not (h1 <= 24 and h2 <= 24 and m1 < 60 and m2 < 60) or h1 * 60 + m1 == h2 * 60 + m2:
            raise ValueError(f"--hours must be two different times of day, like 22-07; got {text!r}")
        return cls((h1 * 60 + m1) % 1440, (h2 * 60 + m2) % 1440)

    def contain(self, now: datetime) -> bool:
        minute = now.hour * 60 + now.minute
        if self.start == self.end:  # 0-24
            return True
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    def __str__(self) -> str:
        return f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"


def idle_reason(hours: Hours | None, data_dir: Path, now: datetime) -> str | None:
    """Why the node should take no lease now, or None when it should work."""
    if (data_dir / PAUSE_FILE).exists():
        return "paused (echo-node resume to go on)"
    if hours is not None and not hours.contain(now):
        return f"outside its hours ({hours}); it goes on at {str(hours)[:5]}"
    return None


def set_paused(data_dir: Path, paused: bool) -> None:
    """What `echo-node pause` and `resume` do."""
    path = data_dir / PAUSE_FILE
    if paused:
        data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text("paused by echo-node pause; echo-node resume removes this file\n")
    else:
        path.unlink(missing_ok=True)
