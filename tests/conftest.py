"""Shared pytest options: ``--wide`` turns on the full parity sweeps."""

from __future__ import annotations

import pytest

# support_git is loaded as a plugin by several test modules; register it before
# any of them imports it so its asserts are rewritten like a test module's.
pytest.register_assert_rewrite("support_git")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--wide",
        action="store_true",
        default=False,
        help="run the wide sweeps (the full ~8,100-case parity matrix per toolchain)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--wide"):
        return
    skip = pytest.mark.skip(reason="wide sweep: run with --wide")
    for item in items:
        if "wide" in item.keywords:
            item.add_marker(skip)
