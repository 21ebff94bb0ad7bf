"""Shared pytest options: ``--wide`` (full parity sweeps) and ``--mlx-build`` (real builds)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from patchkit.util import cache

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


# Content-addressed caches every test may share with the user's: the stock wheels (a
# download) and the emulator's compiled kernels (minutes to build).
SHARED_WITH_USER = ("wheels", "emulate")
USER_DEPS_ENV = "PATCHKIT_TEST_USER_DEPS"


@pytest.fixture(autouse=True, scope="session")
def _leave_the_user_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test runs with its own cache root and git identity, never the user's: clones,
    builds and locks in a session folder (the shared caches above linked in), and a global
    git config of its own, so the suite passes on an account with no git identity and
    leaves the user's cache and git config as they were."""
    real = cache.root()
    session = tmp_path_factory.mktemp("patchkit-cache")
    for name in SHARED_WITH_USER:
        (real / name).mkdir(parents=True, exist_ok=True)
        (session / name).symlink_to(real / name, target_is_directory=True)
    gitconfig = session.parent / "gitconfig"
    gitconfig.write_text("[user]\n\tname = patchkit tests\n\temail = tests@patchkit.invalid\n")
    patch = pytest.MonkeyPatch()
    patch.setenv(cache.ENV, str(session))
    # Read only, by the CUDA compile tests: MLX's configure-time sources the user exported
    # (`patchkit deps`); the session's own deps folder stays empty for the tests that
    # expect a fresh one.
    patch.setenv(USER_DEPS_ENV, str(real / "deps"))
    patch.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
    patch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    yield
    patch.undo()
