"""pin.toml: round trip, comment-preserving writes, and the blob checks that gate apply/check."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchkit.carry import pin
from patchkit.errors import BlobMismatchError, UserError

QH = "mlx/backend/metal/kernels/quantized.h"
CPP = "mlx/backend/metal/quantized.cpp"
SHA = "9a795735ad9a42664e08f42361b405ed570bcf1a"
BLOBS = {
    QH: "f628c0561227b709e455d91dc0a0f5885368f26a",
    CPP: "5db3893226bd8617e6dbaaf75e6be5f4ebca829e",
}


def _pin(**kw: object) -> pin.Pin:
    base = {
        "commit": SHA,
        "blobs": BLOBS,
        "release": "0.32.1",
        "history": (pin.Bump("", SHA, "2026-08-22", "initial pin"),),
    }
    return pin.Pin(**{**base, **kw})  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "pin.toml"
    assert pin.save(_pin(), path)
    loaded = pin.load(path)
    assert loaded == _pin()
    assert loaded.short == "9a795735"
    assert not pin.save(_pin(), path)  # unchanged: not rewritten


def test_a_rebase_entry_is_short_and_structured(tmp_path: Path) -> None:
    bump = pin.Bump(SHA, "a" * 40, "2026-12-02", "rebase", ("qdot",), ("dispatch_qmv",), "passed")
    path = tmp_path / "pin.toml"
    pin.save(_pin(commit="a" * 40, history=(*_pin().history, bump)), path)
    assert pin.load(path).history[-1] == bump
    entry = path.read_text().split("[[history]]")[-1]
    assert 'called = ["qdot"]' in entry and 'parity = "passed"' in entry
    assert max(len(line) for line in entry.splitlines()) < 100


def test_save_keeps_a_hand_written_comment_and_drops_release(tmp_path: Path) -> None:
    path = tmp_path / "pin.toml"
    pin.save(_pin(), path)
    path.write_text(path.read_text() + "# reviewed\n")
    bumped = _pin(
        commit="a" * 40, release="", history=(*_pin().history, pin.Bump(SHA, "a" * 40, "d"))
    )
    pin.save(bumped, path)
    text = path.read_text()
    assert "# reviewed" in text
    assert "release" not in text
    assert pin.load(path).history[-1].new == "a" * 40
    assert not list(tmp_path.glob(".pin.toml.*"))  # staging file renamed away


@pytest.mark.parametrize(
    "content",
    ["", "[upstream]\nurl = 'x'\n", "not toml = = ="],
    ids=["empty", "no-commit", "syntax"],
)
def test_malformed_is_a_user_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "pin.toml"
    path.write_text(content)
    with pytest.raises(UserError, match="malformed"):
        pin.load(path)


def test_missing_file_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="patchkit apply --pin"):
        pin.load(tmp_path / "pin.toml")


@pytest.mark.parametrize(
    ("tree", "touched", "error"),
    [
        # tree blobs         touched files   expected failure (None = passes)
        (BLOBS, [QH, CPP], None),
        ({**BLOBS, QH: "0" * 40}, [QH, CPP], "is blob 0000"),
        ({CPP: BLOBS[CPP]}, [QH, CPP], "is blob missing"),
        (BLOBS, [QH, CPP, "mlx/x.h"], "missing \\['mlx/x.h'\\]"),
        (BLOBS, [QH], "extra \\['mlx/backend/metal/quantized.cpp'\\]"),
    ],
    ids=["match", "changed-blob", "file-gone", "new-touched-file", "dropped-touched-file"],
)
def test_verify(tree: dict[str, str], touched: list[str], error: str | None) -> None:
    if error is None:
        pin.verify(_pin(), tree.get, touched)
        return
    with pytest.raises(BlobMismatchError, match=error):
        pin.verify(_pin(), tree.get, touched)


def test_an_oversized_pin_is_refused_before_parsing(tmp_path: Path) -> None:
    """A pin.toml of megabytes is not patchkit's: one line, quickly, not a long parse."""
    import time

    path = tmp_path / "pin.toml"
    body = "[upstream]\ncommit = '" + "a" * 40 + "'\n"
    path.write_text(body + "# padding\n" * ((2 << 20) // 10))
    started = time.monotonic()
    with pytest.raises(UserError, match=r"malformed .*over patchkit's 1,048,576-byte limit") as e:
        pin.load(path)
    assert time.monotonic() - started < 1.0 and "\n" not in str(e.value)
    path.write_text(body)  # control: the same pin, small, loads
    assert pin.load(path).commit == "a" * 40
