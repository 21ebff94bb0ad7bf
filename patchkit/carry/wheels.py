"""Real MLX kernel headers from the ``mlx-cpu`` wheels on PyPI, cached for offline reuse.

The wheels ship ``mlx/include/mlx/backend/metal/kernels/*.h``; ``mlx-cpu==0.32.1``
is byte-identical to the pin for the quantized headers, and ``0.32.4`` is a real
later release. That gives tests and the CPU emulator genuine upstream text
without a full clone. Downloads go through ``pip download`` (the ordinary client)
into patchkit's cache; an extracted tree is staged and renamed into place, and is
reused without the network afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from patchkit.errors import ToolError, UserError
from patchkit.util import cache, proc

PACKAGE = "mlx-cpu"
INCLUDE_PREFIX = "mlx/include/"


def wheel_dir(version: str) -> Path:
    """Cache directory for one wheel version (in the cache's ``wheels`` folder)."""
    return cache.folder("wheels") / f"{PACKAGE}-{version}"


def download(version: str) -> Path:
    """Path of the cached ``mlx-cpu==version`` wheel, downloading it once with pip."""
    dest = wheel_dir(version)
    found = sorted(dest.glob("*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".dl.", dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",  # only the headers matter; mlx-cpu's deps are irrelevant here
            "--only-binary=:all:",  # a wheel, never an sdist build
            "--disable-pip-version-check",
            "--quiet",
            "-d",
            tmp,
            f"{PACKAGE}=={version}",
        ]
        try:
            proc.run(cmd)
        except ToolError as err:
            raise UserError(
                f"cannot download {PACKAGE}=={version} and it is not cached; check the network"
                f" or pip's index settings ({str(err).splitlines()[0]})"
            ) from err
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise UserError(f"pip download of {PACKAGE}=={version} left no wheel in {tmp}")
        os.replace(wheels[0], dest / wheels[0].name)
    return dest / wheels[0].name


def header_tree(version: str) -> Path:
    """The extracted ``mlx/include`` root of ``mlx-cpu==version`` (download once, then offline)."""
    root = wheel_dir(version) / "include"
    if root.exists():
        return root
    wheel = download(version)
    stage = Path(tempfile.mkdtemp(prefix=".extract.", dir=root.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith(INCLUDE_PREFIX) and not name.endswith("/"):
                    zf.extract(name, stage)
        os.replace(stage / "mlx" / "include", root)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return root


def header_path(version: str, upstream_path: str) -> Path:
    """Where ``mlx/backend/...`` (an upstream repo path) lives in the wheel's header tree."""
    if not upstream_path.startswith("mlx/"):
        raise UserError(f"{upstream_path} is not under mlx/; wheels ship only the mlx/ headers")
    return header_tree(version) / upstream_path


def read_header(version: str, upstream_path: str) -> str:
    """Text of an upstream header as shipped in ``mlx-cpu==version``, byte for byte."""
    path = header_path(version, upstream_path)
    if not path.is_file():
        raise UserError(
            f"{upstream_path} is not in {PACKAGE}=={version} (wheels ship headers only);"
            " use a clone via --mlx-repo for .cpp/.metal files"
        )
    return path.read_bytes().decode("utf-8", "surrogateescape")
