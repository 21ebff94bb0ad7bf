"""``patchkit clean``: shows the cache, frees it on --yes, never what a running patchkit holds."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchkit.carry import clean
from patchkit.cli import main
from patchkit.util import staging


def _hold(lock: str, ready: multiprocessing.synchronize.Event, done: object) -> None:
    """Another patchkit run: holds ``lock`` until told to stop."""
    with staging.exclusive(Path(lock)):
        ready.set()
        done.wait(60)  # type: ignore[attr-defined]


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(root))
    for build in ("cpu-9a795735", "cuda-9a795735"):
        (root / "builds" / build / "venv").mkdir(parents=True)
        (root / "builds" / build / "build.log").write_text("x" * 1000)
    (root / "clones" / "mlx.git").mkdir(parents=True)
    (root / "clones" / "mlx.git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "emulate" / "lib.so").parent.mkdir(parents=True)
    (root / "emulate" / "lib.so").write_bytes(b"\0" * 2048)
    return root


def test_clean_shows_sizes_and_removes_nothing_without_yes(cache_root: Path) -> None:
    r = CliRunner().invoke(main, ["clean", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["folder"]: row for row in json.loads(r.stdout)["folders"]}
    assert rows["builds"]["bytes"] == 2000 and rows["emulate"]["bytes"] == 2048
    assert not rows["clones"]["freed_by_default"] and rows["builds"]["freed_by_default"]
    assert (cache_root / "builds" / "cpu-9a795735" / "build.log").exists()


def test_clean_yes_frees_the_defaults_but_not_a_build_in_use(
    cache_root: Path, tmp_path: Path
) -> None:
    checkout = tmp_path / "checkout"  # a user's files beside the cache: never touched
    checkout.mkdir()
    (checkout / "pin.toml").write_text("mine\n")
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    lock = cache_root / "builds" / "cuda-9a795735.lock"
    holder = ctx.Process(target=_hold, args=(str(lock), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        r = CliRunner().invoke(main, ["clean", "--yes", "--json"])
    finally:
        done.set()
        holder.join(60)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["in_use"] == [str(cache_root / "builds" / "cuda-9a795735")]
    assert (cache_root / "builds" / "cuda-9a795735" / "build.log").exists()  # held: kept whole
    assert not (cache_root / "builds" / "cpu-9a795735").exists()  # control: free, removed
    assert not (cache_root / "emulate").exists()
    assert (cache_root / "clones" / "mlx.git" / "HEAD").exists()  # only when named
    assert (checkout / "pin.toml").read_text() == "mine\n"
    assert not any((cache_root / ".trash").iterdir())
    named = clean.free(("clones",))
    assert named["removed"] == [str(cache_root / "clones" / "mlx.git")]
