"""Timing of the verify forward and the speculative-loop throughput it implies.

Times come from ``mx.eval`` + ``mx.synchronize`` around whole forwards (graph
building included, as a decoder pays it), median of ``repeats`` after warm-ups.
Absolute numbers mean something on a GPU only; on the CPU they are recorded
but not the point.

The throughput model (stated in every report): a draft proposes k = T - 1
tokens, each accepted independently with probability ``alpha``; one verify
forward of T positions then yields on average

    E[tokens] = (1 - alpha**T) / (1 - alpha)

tokens (the accepted prefix plus the verifier's own next token). With the draft
taken as free (an MTP head or an ideal drafter: an upper bound on the gain),
tokens per second = E[tokens] / t_verify(T). Plain decoding is 1 / t_forward(1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from patchkit.verify.probe.exact import chain
from patchkit.verify.probe.model import Cache, Linear, Model, forward

FORMULA = (
    "tok/s = E[tokens per verify] / t_verify(T), E = (1 - a**T) / (1 - a) for draft length "
    "k = T - 1 and per-token acceptance a (independent), draft cost taken as zero; "
    "plain decoding = 1 / t_forward(1); batch 1"
)


def _mx() -> Any:
    import mlx.core as mx

    return mx


def expected_tokens(T: int, alpha: float) -> float:
    """Mean tokens one verify of T positions yields (accepted drafts + the verifier's token)."""
    if alpha >= 1.0:
        return float(T)
    return (1.0 - alpha**T) / (1.0 - alpha)


def median_seconds(fn: Callable[[], Any], repeats: int, warm: int = 2) -> float:
    """Median wall time of ``fn`` evaluated and synchronized."""
    mx = _mx()
    for _ in range(warm):
        mx.eval(fn())
    mx.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def time_arm(
    model: Model, tokens: Any, cache: Cache, linear: Linear, ts: list[int], repeats: int
) -> dict[int, dict[str, float]]:
    """Per T: seconds of the block forward and of the chain of T single forwards."""
    out: dict[int, dict[str, float]] = {}
    for t in sorted({1, *ts}):
        blk = median_seconds(lambda t=t: forward(model, tokens[:t], cache, linear)[0], repeats)
        chn = median_seconds(lambda t=t: chain(model, tokens[:t], cache, linear)[0], repeats)
        out[t] = {"block_s": blk, "chain_s": chn}
    return out


def throughput(times: dict[int, dict[str, float]], alpha: float) -> dict[str, Any]:
    """tok/s per T for block and chain verification, the best T of each, and plain decoding."""
    plain = 1.0 / times[1]["block_s"]
    per_t = {
        t: {
            "expected_tokens": expected_tokens(t, alpha),
            "block_tok_s": expected_tokens(t, alpha) / v["block_s"],
            "chain_tok_s": expected_tokens(t, alpha) / v["chain_s"],
        }
        for t, v in times.items()
        if t > 1
    }
    best = max(per_t, key=lambda t: per_t[t]["block_tok_s"]) if per_t else None
    return {
        "alpha": alpha,
        "plain_decode_tok_s": plain,
        "per_T": per_t,
        "best_T_block": best,
        "best_block_tok_s": per_t[best]["block_tok_s"] if best else None,
    }
