"""The committed patches/ carry what the templates render now, checked offline.

`patchkit check` needs an MLX clone; CI has none. The kernel header, though, is
available offline (the release-twin wheel, blob-checked), and it is the file
the templates change most. So: apply the committed series' hunks for that file
to the pinned header and compare with a fresh render, and compare the overlay
copy too. A template edited without re-running `patchkit apply` fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from patchkit.carry import export, pin, render
from patchkit.util import git
from patchkit.verify import emulate

ROOT = Path(__file__).resolve().parent.parent
HEADER = emulate.QUANTIZED_H


@pytest.fixture(scope="module")
def pinned() -> pin.Pin:
    return pin.load(ROOT / "pin.toml")


@pytest.fixture(scope="module")
def fresh(pinned: pin.Pin) -> str:
    upstream = emulate.pinned_header(ROOT)
    options = render.RenderOptions()
    plan = next(p for p in render.selected_plans(options) if p.path == HEADER)
    return render.render_file(plan, upstream, options)


def _series_applied(pinned: pin.Pin, tmp_path: Path) -> str:
    (tmp_path / Path(HEADER).parent).mkdir(parents=True)
    (tmp_path / HEADER).write_text(emulate.pinned_header(ROOT))
    git.init(tmp_path)
    pdir = ROOT / "patches" / pinned.short
    for name in (pdir / "series").read_text().split():
        git.run(tmp_path, "apply", f"--include={HEADER}", str(pdir / name))
    return (tmp_path / HEADER).read_text()


def test_series_hunks_for_the_kernel_header_match_a_fresh_render(
    pinned: pin.Pin, fresh: str, tmp_path: Path
) -> None:
    assert _series_applied(pinned, tmp_path) == fresh, (
        "patches/ is stale for the kernel header: re-run `patchkit apply --pin "
        f"{pinned.short}` and commit patches/"
    )


def test_overlay_copy_of_the_kernel_header_matches_a_fresh_render(pinned: pin.Pin) -> None:
    # The overlay flavour: the PR's kernels, with qmv_wide kept for its off switch.
    options = render.RenderOptions(flavour="overlay")
    plan = next(p for p in render.selected_plans(options) if p.path == HEADER)
    fresh = render.render_file(plan, emulate.pinned_header(ROOT), options)
    overlay = ROOT / "patches" / pinned.short / "overlay" / HEADER
    assert export.strip_header(HEADER, overlay.read_text()) == fresh
