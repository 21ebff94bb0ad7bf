"""Against a full MLX clone: the real templates applied at the pin, and a real rebase.

Needs a clone holding the pin 9a795735: set PATCHKIT_MLX_REPO to a local MLX
clone (e.g. `git clone --bare https://github.com/ml-explore/mlx`). Without one
these tests skip, saying so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support_git import QH, mlx_clone

from patchkit.carry import apply, pin, rebase, render, source
from patchkit.util import git

PIN = "9a795735ad9a42664e08f42361b405ed570bcf1a"
LATER_TOUCHING_QUANTIZED_CPP = "a082cb91d"  # qmm_t_nax change in metal/quantized.cpp
METAL = [
    "mlx/backend/metal/kernels/fp_quantized.h",
    "mlx/backend/metal/kernels/fp_quantized.metal",
    "mlx/backend/metal/kernels/quantized.h",
    "mlx/backend/metal/kernels/quantized.metal",
    "mlx/backend/metal/quantized.cpp",
]

pytestmark = [
    pytest.mark.clone,
    pytest.mark.skipif(
        mlx_clone() is None,
        reason="needs a full MLX clone with commit 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx"
        " or run `patchkit apply --pin 9a795735` once to fill the clone cache",
    ),
]


SPEC = mlx_clone()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A scratch project root; the clone cache stays the user's (re-cloning per test is waste)."""
    root = tmp_path / "project"
    root.mkdir()
    return root


def test_apply_at_pin_touches_kernel_instantiation_and_dispatch(project: Path) -> None:
    metal = render.RenderOptions(("metal",))
    r = apply.apply(PIN, root=project, mlx_repo=SPEC, options=metal, release="0.32.1")
    clone = source.ensure_clone(source.source_spec(SPEC))
    assert git.out(clone, "diff", "--name-only", PIN, r.head).splitlines() == METAL
    assert pin.load(project / "pin.toml").blobs[QH] == "f628c0561227b709e455d91dc0a0f5885368f26a"
    again = apply.apply(PIN[:8], root=project, mlx_repo=SPEC, options=metal)
    assert (again.head, again.patches_changed, again.pin_changed) == (r.head, False, False)


def test_rebase_to_a_later_commit_that_changes_unrelated_code(project: Path) -> None:
    apply.apply(PIN, root=project, mlx_repo=SPEC)
    before = (project / "patches" / PIN[:8]).exists()

    seen: list[tuple[str, ...]] = []

    def parity(*headers: str) -> rebase.Parity:
        # The real suite costs ~45 s; the real gate runs in test_rebase with --wide.
        seen.append(headers)  # (upstream's header, the patched one)
        return rebase.Parity(True, "stub")

    r = rebase.rebase(
        LATER_TOUCHING_QUANTIZED_CPP, root=project, mlx_repo=SPEC, parity_check=parity
    )
    assert len(seen) == 1 and seen[0][0] != seen[0][-1]  # the patched header was judged
    assert before and r.written and r.changed_mirrored == {} and r.merged_files == []
    assert not (project / "patches" / PIN[:8]).exists()
    assert (project / "patches" / r.new[:8] / "series").is_file()
    shutil.rmtree(project / "patches")
