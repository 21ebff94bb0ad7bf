"""One cache root: PATCHKIT_CACHE_DIR moves every folder patchkit keeps between runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchkit.carry import export_pr, mlx_build, mlx_deps, source, wheels
from patchkit.util import cache
from patchkit.verify.emulate import build


def test_every_cache_folder_is_under_the_one_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    found = {
        "clones": source.clone_dir("https://github.com/ml-explore/mlx").parent,
        "deps": mlx_deps.deps_root(),
        "builds": mlx_build.layout("cpu", "9a795735").base.parent,
        "emulate": build.cache_dir(),
        "wheels": wheels.wheel_dir("0.32.1").parent,
        "tools": export_pr.tools_venv({"black": "26.1.0"}).parent,
    }
    assert found == {name: tmp_path / name for name in found}
    assert set(found) < set(cache.FOLDERS)
    with pytest.raises(ValueError, match="unknown cache folder"):
        cache.folder("elsewhere")  # type: ignore[arg-type]
