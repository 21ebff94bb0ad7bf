"""Block versus chain, byte for byte, and per-op parity to say which op breaks identity.

The probe downstream engines gate multi-token prediction on: from one cache
state, one verify forward of T positions (the block) against T single-token
forwards (the chain), logits compared as raw bytes. No tolerance anywhere: two
logits are the same when their bit patterns are.

When the block differs, :func:`per_op` says where: it re-runs every op of the
traced block forward one position at a time on the block's own inputs (an M = 1
linear on that row; one query row against the cache up to its position), so each
op is judged on identical inputs, independent of any divergence upstream of it.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from patchkit.verify.probe.model import Cache, Linear, Model, Trace, forward


def _mx() -> Any:
    import mlx.core as mx

    return mx


def _np(a: Any) -> Any:
    """The array's raw bit patterns as numpy (uint16 for 16-bit floats, uint32 for float32)."""
    import numpy as np

    mx = _mx()
    view = {2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.array(a.view(view))


def state_digest(cache: Cache) -> str:
    """sha256 over every cache array's bytes: shows the block and chain start from one state."""
    h = hashlib.sha256()
    for k, v in cache:
        h.update(_np(k).tobytes())
        h.update(_np(v).tobytes())
    return h.hexdigest()


def chain(model: Model, tokens: Any, cache: Cache, linear: Linear) -> tuple[Any, Cache]:
    """T single-token forwards, each from the cache the previous one produced."""
    mx = _mx()
    rows = []
    for i in range(tokens.shape[0]):
        logits, cache = forward(model, tokens[i : i + 1], cache, linear)
        mx.eval(logits, cache)  # as a decoder would: one step at a time
        rows.append(logits)
    return mx.concatenate(rows, axis=0), cache


@dataclass
class Verdict:
    """One T: is the block's logits byte-identical to the chain's?"""

    T: int
    identical: bool
    differing_logits: int
    first_differing_position: int | None
    max_abs_diff: float
    greedy_block: list[int]
    greedy_chain: list[int]
    cache_after_identical: bool
    start_state_block: str
    start_state_chain: str


def compare(block: Any, chain_logits: Any) -> tuple[int, int | None, float]:
    """(differing elements, first differing position, max |diff| for information only)."""
    import numpy as np

    mx = _mx()
    diff = _np(block) != _np(chain_logits)
    rows = np.flatnonzero(diff.any(axis=1))
    a = np.array(block.astype(mx.float32))
    b = np.array(chain_logits.astype(mx.float32))
    return int(diff.sum()), (int(rows[0]) if rows.size else None), float(np.max(np.abs(a - b)))


def _same_cache(a: Cache, b: Cache) -> bool:
    import numpy as np

    return all(
        np.array_equal(_np(x), _np(y))
        for (ka, va), (kb, vb) in zip(a, b, strict=True)
        for x, y in ((ka, kb), (va, vb))
    )


def block_vs_chain(
    model: Model, tokens: Any, cache: Cache, linear: Linear, trace: Trace | None = None
) -> Verdict:
    """Run the block and the chain of ``tokens`` from ``cache``; the bytes decide."""
    mx = _mx()
    start_b = state_digest(cache)
    logits_b, cache_b = forward(model, tokens, cache, linear, trace)
    mx.eval(logits_b, cache_b)
    start_c = state_digest(cache)  # again: the block must not have touched the state
    logits_c, cache_c = chain(model, tokens, cache, linear)
    n, first, mad = compare(logits_b, logits_c)
    return Verdict(
        T=int(tokens.shape[0]),
        identical=n == 0,
        differing_logits=n,
        first_differing_position=first,
        max_abs_diff=mad,
        greedy_block=mx.argmax(logits_b, axis=-1).tolist(),
        greedy_chain=mx.argmax(logits_c, axis=-1).tolist(),
        cache_after_identical=_same_cache(cache_b, cache_c),
        start_state_block=start_b,
        start_state_chain=start_c,
    )


def per_op(trace: Trace) -> dict[str, dict[str, Any]]:
    """Per op name: positions whose block output differs from its one-position recompute.

    ``rows_differing`` sums over layers; ``layers_differing`` lists the layers
    where any position differs; ``calls`` is how many (layer) calls were checked.
    """
    import numpy as np

    mx = _mx()
    out: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"calls": 0, "rows_differing": 0, "layers_differing": []}
    )
    # One eval for every op's one-position recomputes: thousands of tiny evals would
    # dominate a GPU run; evaluation order cannot change any op's result.
    singles = [[c.single(i) for i in range(c.out.shape[c.axis])] for c in trace.calls]
    mx.eval([c.out for c in trace.calls], singles)
    for call, rows in zip(trace.calls, singles, strict=True):
        block = _np(call.out)
        bad = sum(
            not np.array_equal(np.take(block, [i], axis=call.axis), _np(s))
            for i, s in enumerate(rows)
        )
        rec = out[call.name]
        rec["calls"] += 1
        rec["rows_differing"] += int(bad)
        if bad:
            rec["layers_differing"].append(call.layer)
    return dict(out)
