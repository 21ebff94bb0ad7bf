"""patchkit: carry an order-preserving streamed qmv over a pinned MLX commit."""

import json
import signal
import sys
import threading
from pathlib import Path

__version__ = "0.1.0"

EXIT_INTERRUPTED = 130


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """Ctrl-C before the CLI's own handler exists (imports take most of a second): the same
    answer as later, one line and, under ``--json``, one JSON object; nothing was written."""
    message = "interrupted while starting; nothing was written"
    if "--json" in sys.argv[1:]:
        payload = {"ok": False, "error": message, "kind": "KeyboardInterrupt"}
        sys.stdout.write(json.dumps(payload | {"exit": EXIT_INTERRUPTED}) + "\n")
        sys.stdout.flush()
    sys.stderr.write(f"patchkit: error: {message}\n")
    raise SystemExit(EXIT_INTERRUPTED)


def restore_interrupt() -> None:
    """Give Ctrl-C back to Python (KeyboardInterrupt), once the CLI can answer it."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Only when this process is the `patchkit` command: importing patchkit as a library (tests,
# `python -m patchkit.verify...`) changes no signal handling.
if (
    Path(sys.argv[0]).name == "patchkit"
    and threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) is signal.default_int_handler
):
    signal.signal(signal.SIGINT, _interrupted_while_starting)
