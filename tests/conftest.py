"""Shared pytest options: ``--wide`` (full parity sweeps) and ``--mlx-build`` (real builds)."""

from __future__ import annotations

import pytest

# support_git and support_emulate are imported by several test modules; register them before
# any of them imports them so their asserts are rewritten like a test module's.
pytest.register_assert_rewrite("support_git", "support_emulate")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--wide",
        action="store_true",
        default=False,
        help="run the wide sweeps (the full ~8,100-case parity matrix per toolchain)",
    )
    parser.addoption(
        "--mlx-build",
        action="store_true",
        default=False,
        help="build MLX from the patched tree (minutes to an hour) and run its tests",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for flag, mark in (("--wide", "wide"), ("--mlx-build", "mlx_build")):
        if config.getoption(flag):
            continue
        skip = pytest.mark.skip(reason=f"{mark.replace('_', ' ')}: run with {flag}")
        for item in items:
            if mark in item.keywords:
                item.add_marker(skip)
