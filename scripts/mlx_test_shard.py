"""Run one test of MLX's test file verbosely, whole or on one shard of its parameter grid.

Why: on CUDA, ``test_qmm`` and ``test_qvm`` run hundreds of subtests from one
``itertools.product`` grid, a few seconds each: too long for one process within a time
limit on a GPU host. Shard ``i`` of ``n`` runs the test's own body and assertions on every ``n``-th
point of that grid starting at the ``i``-th, so ``n`` processes together run each point
exactly once. Only the first ``product`` the test calls is split (its outer grid): an inner
``product`` of a nested loop runs whole, so no point is lost where a test nests them.

Usage, from the test folder (as ``python -m unittest -v NAME`` would be run):
  python mlx_test_shard.py test_quantized.TestQuantized.test_qmm        the whole test
  python mlx_test_shard.py test_quantized.TestQuantized.test_qmm@2of6   shard 2 of 6
The output is unittest's own (``-v``), so a shard's log reads like any test's log.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import unittest
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def parse(name: str) -> tuple[str, int, int]:
    """``module.Class.test@IofN`` -> (``module.Class.test``, I - 1, N); whole: (name, 0, 1)."""
    test, sep, shard = name.partition("@")
    if not sep:
        return test, 0, 1
    index, of, count = shard.partition("of")
    if not (of and index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise SystemExit(f"mlx_test_shard.py: bad shard {shard!r} in {name!r} (want @IofN)")
    return test, int(index) - 1, int(count)


def first_product_sharded(index: int, count: int) -> Callable[..., Iterator[Any]]:
    """An ``itertools.product`` whose first call yields only shard ``index`` of ``count``."""
    calls = 0

    def product(*iterables: Iterable[Any], repeat: int = 1) -> Iterator[Any]:
        nonlocal calls
        calls += 1
        grid = itertools.product(*iterables, repeat=repeat)
        return itertools.islice(grid, index, None, count) if calls == 1 else grid

    return product


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: mlx_test_shard.py module.Class.test[@IofN]")
    test, index, count = parse(argv[0])
    sys.path.insert(0, os.getcwd())  # the test folder, as `python -m unittest` has it
    if count > 1:
        module = importlib.import_module(test.split(".", 1)[0])
        if getattr(module, "product", None) is not itertools.product:
            raise SystemExit(f"mlx_test_shard.py: {module.__name__} has no itertools.product "
                             "to shard")  # fmt: skip
        module.product = first_product_sharded(index, count)
    program = unittest.main(module=None, argv=["mlx_test_shard.py", "-v", test], exit=False)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
