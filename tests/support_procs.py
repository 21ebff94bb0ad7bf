"""Whether a process a test started is still running, for tests that stop processes.

A process whose parent died is reparented and reaped later: until then it is a zombie,
which has ended. Linux only (``/proc``), as the stopping it checks is.
"""

from __future__ import annotations

import time
from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie not yet reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def ends_within(pid: int, seconds: float = 2.0) -> bool:
    """Whether ``pid`` has ended or ends within ``seconds``."""
    end = time.monotonic() + seconds
    while running(pid):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True
