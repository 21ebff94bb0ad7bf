"""The README's set-up is what CI runs, and it works outside any prepared environment.

CI (`.ci/run`) and `../shared/tools/fresh-try.sh` run the README's first two ``sh`` blocks
as written; these tests keep the blocks, CI and what a fresh Debian/Ubuntu machine needs in
step, without running them (the whole path takes minutes: fresh-try.sh does that).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(?:sh|bash|shell)\n(.*?)```", README, re.S)
CI = (ROOT / ".ci" / "run").read_text()


def _lines(block: str) -> list[str]:
    return [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def test_ci_runs_exactly_the_readmes_two_commands() -> None:
    setup, tests = BLOCKS[0], BLOCKS[1]
    commands = [ln for ln in _lines(CI) if not ln.startswith(("set ", "cd "))]
    lint = [ln for ln in commands if ln.startswith(".venv/bin/ruff ")]
    assert commands == [*_lines(setup), *lint, *_lines(tests)]
    assert len(lint) == 2  # ruff check, ruff format --check


def test_setup_needs_no_prepared_environment() -> None:
    """PEP 668: no pip into the system Python; the venv the first block makes is what the
    second uses (fresh-try.sh runs each block in a shell of its own)."""
    setup, tests = BLOCKS[0], BLOCKS[1]
    assert "python3 -m venv .venv" in setup
    assert not re.search(r"(^|&& |; )(python3 -m pip|pip3?) install", setup, re.M)
    assert ".venv/bin/pip install" in setup and ".venv/bin/patchkit emulate" in setup
    assert tests.strip().startswith(". .venv/bin/activate && ")
    # What the main job and `patchkit build --backend cpu` need from the system (Debian
    # names), each of which the build's preflight would otherwise name.
    for package in ("g++", "clang", "cmake", "ninja-build", "git", "python3-venv",
                    "libblas-dev", "liblapack-dev", "liblapacke-dev"):  # fmt: skip
        assert f" {package}" in setup, package
    # The set-up commands come early, and say why a venv.
    assert README.index(BLOCKS[0]) < README.index("## Commands")
    assert "PEP 668" in README


def test_the_readme_says_how_to_use_the_wheel_with_mlx_lm() -> None:
    section = README[README.index("## Use it with mlx-lm") :]
    section = section[: section.index("\n## ", 1)]
    assert "--draft-model" in section and "patchkit build --into" in section
    # the install path is --into (which keeps the wheel), and says what pip then refuses
    assert "pip.conf" in section and "mlx>=0.32.2" in section
    assert "pip uninstall" not in section  # no order of steps that ends in a broken import
    assert "docs/" in section  # where the off switch is described
