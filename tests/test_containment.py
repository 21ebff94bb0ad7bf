"""A transaction journal read back from disk cannot reach outside what it may change.

``patches/.txn/journal.json`` is git-ignored, but a tarball, a shared folder or a CI cache
can deliver one; the next writer replays it. Every entry is checked before the first
rename: an install's source inside the transaction's stage, its target and every removal
inside the checkout, under ``patches/`` or ``pin.toml``, links followed. Anything else is
one UserError naming the entry, with nothing touched. Control: a journal the transaction
itself wrote is replayed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from patchkit.carry import transaction
from patchkit.errors import UserError
from patchkit.util import staging


def _checkout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(checkout root, its transaction folder with a staged file, a file outside it)."""
    root = tmp_path / "checkout"
    txn = root / transaction.PATCHES / transaction.TXN_DIR
    (txn / "stage").mkdir(parents=True)
    (txn / "stage" / "new.patch").write_text("new\n")
    (root / "README.md").write_text("mine\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return root, txn, victim


def _journal(txn: Path, ops: object) -> None:
    (txn / staging.JOURNAL).write_text(json.dumps(ops))


STAGED = "patches/.txn/stage/new.patch"
BAD_JOURNALS = {
    "remove outside": [{"op": "remove", "path": "../victim"}],
    "install over outside": [{"op": "install", "from": STAGED, "to": "../victim"}],
    "absolute": [{"op": "remove", "path": "/tmp/victim-absolute"}],
    "a user file in the checkout": [{"op": "remove", "path": "README.md"}],
    "the checkout itself": [{"op": "remove", "path": "."}],
    "the transaction folder": [{"op": "remove", "path": "patches/.txn"}],
    "source outside the stage": [{"op": "install", "from": "../victim", "to": "pin.toml"}],
    "through a link": [{"op": "remove", "path": "patches/out/victim"}],
    "unknown op": [{"op": "chmod", "path": "pin.toml"}],
    "unhashable op": [{"op": ["remove"], "path": "pin.toml"}],
    "extra field": [{"op": "remove", "path": "pin.toml", "also": "../victim"}],
    "not a list": {"op": "remove", "path": "../victim"},
    # A good entry first: the bad second one stops the whole journal before any rename.
    "good then bad": [
        {"op": "install", "from": STAGED, "to": "patches/9a795735/new.patch"},
        {"op": "remove", "path": "../victim"},
    ],
}


@pytest.mark.parametrize("ops", BAD_JOURNALS.values(), ids=BAD_JOURNALS.keys())
def test_a_journal_reaching_outside_is_refused_untouched(tmp_path: Path, ops: object) -> None:
    root, txn, victim = _checkout(tmp_path)
    (root / transaction.PATCHES / "out").symlink_to(tmp_path)
    _journal(txn, ops)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match="refusing the interrupted write") as err:
        transaction.recover_outputs(root)
    assert "\n" not in str(err.value) and "nothing was touched" in str(err.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert victim.read_text() == "precious\n" and (root / "README.md").read_text() == "mine\n"
    # Read-only commands refuse the same way rather than read through it.
    with pytest.raises(UserError, match="refusing"):
        transaction.output_path(root, root / "pin.toml")


def test_a_journal_the_transaction_wrote_is_replayed(tmp_path: Path) -> None:
    """Control: the same checks pass what a real transaction commits."""
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "pin.toml").write_text("old\n")
    txn = transaction.begin_outputs(root)
    (txn.stage / "pin.toml").write_text("new\n")
    txn.install(txn.stage / "pin.toml", root / "pin.toml")
    txn.commit()
    assert (root / "pin.toml").read_text() == "new\n"
    assert not (root / transaction.PATCHES / transaction.TXN_DIR).exists()


def test_an_oversized_journal_is_refused_unread(tmp_path: Path) -> None:
    """A journal of megabytes is no transaction's: refused in one line, nothing touched."""
    root, txn, victim = _checkout(tmp_path)
    (txn / staging.JOURNAL).write_text("[" + " " * (2 << 20) + "]")
    with pytest.raises(UserError, match=r"over patchkit.s .*-byte limit") as err:
        transaction.recover_outputs(root)
    assert "\n" not in str(err.value) and victim.read_text() == "precious\n"
