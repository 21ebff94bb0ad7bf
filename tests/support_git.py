"""Fixtures for the git-side tests (import them explicitly: only the tests that name them pay
for the header repository they build).

The header repository is built once per pytest session from the ``mlx-cpu`` 0.32.1 and
0.32.4 wheels (real upstream text, offline after the first download); every test
that changes it works on its own clone in ``tmp_path``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from patchkit.carry import wheels
from patchkit.util import cache, git

QH = "mlx/backend/metal/kernels/quantized.h"
OLD, NEW = "0.32.1", "0.32.4"
DATE = "2026-08-17T00:00:00+00:00"
PIN_SHA = "9a795735ad9a42664e08f42361b405ed570bcf1a"

# A tiny template set over the real quantized.h: a derived copy of qmv_impl
# (renamed, one substitution) inserted after it. It exercises derive, an
# after_function anchor, both flavours and the mirrored/called dependency lists
# without waiting for the real kernel templates.
EDITS_TOML = """\
backend = "metal"

[depends]
mirrored = ["qmv_fast_impl", "qmv_impl"]
called = ["qdot", "load_vector"]

[[derive]]
function = "qmv_impl"
name = "qmv_copy"
rename = "qmv_patchkit_copy_impl"
replace = [["constexpr int num_simdgroups = 2;", "constexpr int num_simdgroups = 2; // patchkit"]]

[[edit]]
op = "after_function"
anchor = "qmv_impl"
template = "copy.j2"
"""

COPY_J2 = """\
// patchkit test payload ({{ flavour }})
{{ qmv_copy }}
"""


def write_templates(root: Path, edits: str = EDITS_TOML, snippet: str = COPY_J2) -> Path:
    """A templates dir touching only quantized.h; returns its root."""
    d = root / "templates" / QH
    d.mkdir(parents=True, exist_ok=True)
    (d / "edits.toml").write_text(edits)
    (d / "copy.j2").write_text(snippet)
    return root / "templates"


def commit_tree(repo: Path, include_root: Path, message: str) -> str:
    """Replace repo's mlx/ by the wheel's include/mlx tree and commit it."""
    shutil.rmtree(repo / "mlx", ignore_errors=True)
    shutil.copytree(include_root / "mlx", repo / "mlx")
    git.run(repo, "add", "--all")
    return git.commit(repo, message, date=DATE, author=("MLX", "mlx@example.com"))


@pytest.fixture(scope="session")
def header_repo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A git repo with the 0.32.1 headers, then the 0.32.4 headers; read-only for tests."""
    repo = tmp_path_factory.mktemp("upstream") / "mlx"
    git.init(repo)
    old = commit_tree(repo, wheels.header_tree(OLD), f"mlx {OLD} headers")
    git.run(repo, "tag", "v" + OLD)
    new = commit_tree(repo, wheels.header_tree(NEW), f"mlx {NEW} headers")
    git.run(repo, "tag", "v" + NEW)
    return {"path": repo, "old": old, "new": new}


@pytest.fixture
def upstream(header_repo: dict[str, object], tmp_path: Path) -> dict[str, object]:
    """A private clone of the header repo this test may add commits to."""
    path = tmp_path / "upstream"
    git.run(None, "clone", "--quiet", str(header_repo["path"]), str(path))
    return {**header_repo, "path": path}


# Cache folders every test shares: the wheels (a download) and the emulator's
# compiled kernels (minutes to build) are the same for every test.
SHARED_CACHE = ("wheels", "emulate")


def isolate_cache(monkeypatch: pytest.MonkeyPatch, path: Path) -> Path:
    """Point ``PATCHKIT_CACHE_DIR`` at ``path``: clones, builds and locks are the test's
    own, while the shared folders link to the real cache."""
    real = cache.root()
    path.mkdir(parents=True, exist_ok=True)
    for name in SHARED_CACHE:
        (real / name).mkdir(parents=True, exist_ok=True)
        (path / name).symlink_to(real / name, target_is_directory=True)
    monkeypatch.setenv(cache.ENV, str(path))
    return path


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, upstream: dict[str, object]) -> dict:
    """Isolated clone cache, PATCHKIT_MLX_REPO at the test's upstream, a project root."""
    isolate_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("PATCHKIT_MLX_REPO", str(upstream["path"]))
    root = tmp_path / "project"
    root.mkdir()
    templates = write_templates(tmp_path)
    return {"root": root, "templates": templates, **upstream}


def mlx_clone() -> str | None:
    """A source spec for a full MLX clone holding the pin: PATCHKIT_MLX_REPO, else the cache."""
    from patchkit.carry import pin, source

    spec = os.environ.get("PATCHKIT_MLX_REPO")
    candidates = [Path(spec)] if spec and Path(spec).exists() else []
    if not spec:
        spec = pin.UPSTREAM_URL
        candidates = [source.clone_dir(spec)]
    for path in candidates:
        if path.exists() and git.try_rev_parse(path, PIN_SHA) is not None:
            return spec
    return None
