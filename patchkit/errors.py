"""One error hierarchy: library code raises, only the CLI prints and exits."""

from __future__ import annotations


class PatchkitError(Exception):
    """Base class for every error patchkit raises on purpose.

    The message's first line is what the CLI prints as the error; ``details`` (an
    upstream diff, say) follows it on stderr and goes into ``--json`` as is.
    """

    details: str = ""


class UserError(PatchkitError):
    """A problem the user can fix; the message says how, in one line."""


class AnchorError(UserError):
    """A structural anchor (function, macro, statement) was not found in upstream text."""


class BlobMismatchError(UserError):
    """An upstream file's git blob hash is not the one pin.toml records."""


class BusyError(UserError):
    """Another patchkit run holds the lock of the checkout or clone this one writes."""


class GitLockError(UserError):
    """git found a ``.lock`` file (a running git, or one a killed process left)."""


class ToolError(PatchkitError):
    """An external tool (git, a compiler, pip) failed; carries its command and output."""

    def __init__(self, cmd: list[str], returncode: int, stdout: str = "", stderr: str = ""):
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        tail = (stderr or stdout).strip().splitlines()[-20:]
        super().__init__(
            f"{cmd[0]} exited with {returncode}: {' '.join(cmd)}"
            + ("\n" + "\n".join(tail) if tail else "")
        )
