"""Project-agnostic helpers: git over a clone, atomic writes."""

from pathlib import Path

# patchkit's own state files (pin.toml, the transaction journal) are kilobytes; a file many
# times that is not one of them, and parsing it would keep a read-only command busy.
STATE_FILE_LIMIT = 1 << 20


def read_state_text(path: Path, limit: int = STATE_FILE_LIMIT) -> str:
    """``path``'s text, refused (ValueError, one line) past ``limit`` bytes, before reading."""
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{size:,} bytes, over patchkit's {limit:,}-byte limit for this file")
    return path.read_text(encoding="utf-8")
