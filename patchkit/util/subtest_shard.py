"""Run one test method's share of its ``subTest`` blocks: shard K of N.

``python -m patchkit.util.subtest_shard TEST_ID --shard K/N``

Why: on CUDA, MLX's slowest test methods loop over hundreds of ``subTest`` configurations
and spend their time compiling ``qmm`` kernels with NVRTC, one after another. Split by
subtest, one method's compiles run side by side. Consecutive subtests mostly share
their kernels, so each shard takes one contiguous run of them, not every N-th.

How: the test module is loaded from its source with every ``with self.subTest(...):``
body wrapped in a check of this shard's counter; a skipped body still enters its
``subTest`` (unittest reports nothing for it). A first pass with every body skipped
counts the top-level subtests (T); shard K then runs those numbered ``[K*T//N,
(K+1)*T//N)``, the last shard also any past T (a count cut short by an error still
covers everything), and a subtest nested in a running one runs with it. The method's
code outside subtests runs in every shard. The output is ``python -m unittest -v``'s,
after one line ``SHARD K/N: ran [LO, HI) of T counted; E entered (DIGEST)`` that the
parent (:mod:`patchkit.util.split_unittest`) checks: every shard must enter the same E
subtests with the same parameters in the same order (the digest; the parent fixes
``PYTHONHASHSEED`` so that a set's order is one). A method unittest would skip is not
counted. Inputs a test draws from a global random state differ from an unsharded run's;
a subtest body that ends its loop (``break``, ``return``) or defines what later code
reads, or a parameter whose ``repr`` holds a memory address, makes the shards disagree:
an error, never a silent skip.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import sys
import types
import unittest
from typing import Any
from unittest.case import _SubTest

SHARD_NAME = "__patchkit_shard__"
WHOLE_SKIP = "; the method skipped"  # a skip outside subtests: one skipped test, not N
SHARD_LINE = "SHARD {k}/{n}: ran [{lo}, {hi}) of {total} counted; {entered} entered ({digest})"


class Counter:
    """Numbers the top-level subtests as they are entered and says which to run; keeps a
    digest of their parameters in order, so shards can check they met the same ones."""

    def __init__(self) -> None:
        self.lo, self.hi = 0, 0  # run [lo, hi); hi = -1: no upper bound
        self.index = 0
        self.depth = 0
        self.digest = hashlib.sha256()

    def reset(self, lo: int, hi: int) -> None:
        self.lo, self.hi, self.index, self.depth = lo, hi, 0, 0
        self.digest = hashlib.sha256()

    def seen(self, msg: Any, params: dict[str, Any]) -> None:
        """A ``subTest`` is entered with these parameters (top-level ones count)."""
        if not self.depth:
            self.digest.update(repr((msg, sorted(params.items(), key=str))).encode() + b"\0")

    def enter(self) -> bool:
        if self.depth:  # inside a running subtest: run with it
            self.depth += 1
            return True
        index, self.index = self.index, self.index + 1
        if self.lo <= index and (self.hi < 0 or index < self.hi):
            self.depth = 1
            return True
        return False

    def leave(self) -> None:
        self.depth -= 1


def _is_subtest(item: ast.withitem) -> bool:
    call = item.context_expr
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "subTest"
    )


class _WrapSubtests(ast.NodeTransformer):
    def visit_With(self, node: ast.With) -> ast.With:
        self.generic_visit(node)
        if any(_is_subtest(item) for item in node.items):
            shard = ast.Name(SHARD_NAME, ast.Load())
            enter = ast.Call(ast.Attribute(shard, "enter", ast.Load()), [], [])
            leave = ast.Expr(ast.Call(ast.Attribute(shard, "leave", ast.Load()), [], []))
            guarded = ast.Try(body=node.body, handlers=[], orelse=[], finalbody=[leave])
            node.body = [ast.copy_location(ast.If(enter, [guarded], []), node)]
            ast.fix_missing_locations(node)
        return node


def has_subtests(source: str) -> bool:
    """Whether ``source`` (a function or a module) has a ``with self.subTest(...)``."""
    return any(
        isinstance(node, ast.With) and any(_is_subtest(item) for item in node.items)
        for node in ast.walk(ast.parse(source))
    )


def load_module(name: str, counter: Counter) -> types.ModuleType:
    """Import ``name`` from its source with each subtest body behind ``counter``."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"subtest_shard: no module {name!r} here")
    with open(spec.origin, encoding="utf-8") as file:
        tree = _WrapSubtests().visit(ast.parse(file.read(), spec.origin))
    module = importlib.util.module_from_spec(spec)
    module.__dict__[SHARD_NAME] = counter
    sys.modules[name] = module
    # dont_inherit: not this module's ``from __future__ import annotations``
    exec(compile(tree, spec.origin, "exec", dont_inherit=True), module.__dict__)
    subtest = unittest.TestCase.subTest

    def recorded(case: unittest.TestCase, *msg: Any, **params: Any) -> Any:
        counter.seen(msg, params)
        return subtest(case, *msg, **params)

    unittest.TestCase.subTest = recorded  # type: ignore[method-assign]
    return module


def skip_marked(cls: type, method: str) -> bool:
    """Whether unittest would skip ``cls.method`` (a skip decorator on it or its class)."""
    return bool(getattr(cls, "__unittest_skip__", False)
                or getattr(getattr(cls, method, None), "__unittest_skip__", False))  # fmt: skip


def count_subtests(case: unittest.TestCase, counter: Counter) -> int:
    """The method's top-level subtests, entered with every body skipped; an error in the
    method's own code stops the count where it happened."""
    counter.reset(0, 0)
    if skip_marked(type(case), case._testMethodName):
        return 0
    try:
        type(case).setUpClass()
        try:
            case.setUp()
            try:
                getattr(case, case._testMethodName)()
            finally:
                case.tearDown()
        finally:
            case.doCleanups()
            type(case).tearDownClass()
    except Exception:  # the count so far; the last shard runs the rest
        pass
    return counter.index


def run(test_id: str, k: int, n: int) -> int:
    module_name, class_name, method = test_id.rsplit(".", 2)
    counter = Counter()
    module = load_module(module_name, counter)
    cls: Any = getattr(module, class_name)
    total = count_subtests(cls(method), counter)
    lo, hi = k * total // n, (-1 if k == n - 1 else (k + 1) * total // n)
    counter.reset(lo, hi)
    result = unittest.TextTestRunner(verbosity=2).run(
        unittest.defaultTestLoader.loadTestsFromName(test_id)
    )
    print(
        SHARD_LINE.format(k=k, n=n, lo=lo, hi="end" if hi < 0 else hi, total=total,
                          entered=counter.index, digest=counter.digest.hexdigest()[:16])
        + (WHOLE_SKIP if any(not isinstance(t, _SubTest) for t, _ in result.skipped) else ""),
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return 0 if result.wasSuccessful() else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="subtest_shard", description=__doc__.split("\n")[0])
    parser.add_argument("test_id", help="MODULE.CLASS.METHOD, importable from the current folder")
    parser.add_argument("--shard", required=True, help="K/N: this shard of N, from 0")
    args = parser.parse_args(argv)
    try:
        k, n = (int(part) for part in args.shard.split("/"))
    except ValueError:
        parser.error(f"--shard takes K/N, not {args.shard!r}")
    if not 0 <= k < n:
        parser.error(f"--shard {args.shard}: K must be from 0 to N - 1")
    sys.path.insert(0, "")
    return run(args.test_id, k, n)


if __name__ == "__main__":
    sys.exit(main())
