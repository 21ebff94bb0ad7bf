"""The 32 per-lane values each ``simd_sum`` is handed, keyed by the output they produce.

The shim records every ``simd_sum`` call of a launch with where it ran: the
threadgroup, the simdgroup, and the call's index within that simdgroup
(``metal_shim.h``, ``SumRecord``). A kernel's tiling turns that into the
output element the call produces, (batch, vector, output row):

- M = 1 kernels (``qmv_fast``, ``qmv``) run one vector per launch; call j of
  a simdgroup is its row j.
- The same kernels at vecs_per_tg = V run vectors ``tid.x * V ...``; call j is
  vector ``tid.x * V + j // n_rows``, row j % n_rows (the vector loop outside
  the row loop, as the store loop is written). A partial last tile skips the
  vectors past M, so it makes fewer calls.

where the simdgroup's first row and row count are the M = 1 kernel's:
``qmv_fast``'s ``out_row`` and ``results_per_simdgroup`` rows (the launch's
tile: 4 at V > 1); ``qmv``'s ``out_row`` when N < 8 (rows past N guarded) or its
moved-back ``min(N - 4, out_row)`` otherwise, 4 rows.

The mapping is not trusted: every call's result, stored as the kernel stores it
(``T(sum)``, or ``T(sum * inv_scale_enc)`` with nvfp4's global scale), must
equal the output element its key names, and each simdgroup must make exactly
min(V, M - tid.x * V) * n_rows calls. A call that fails either is counted as
unconfirmed, which fails the case. Two kernels whose confirmed calls hand
``simd_sum`` the same 32 values for every output element produce the same result
under *any* reduction tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from patchkit.verify.emulate.families import GLOBAL_SCALE_DIVISOR, storage

# metal_shim.h's SumRecord, field for field.
RECORD = np.dtype(
    [
        ("tid", "<i4", 3),
        ("simdgroup", "<i4"),
        ("call", "<i4"),
        ("lanes", "<f4", 32),
        ("out", "<f4"),
    ]
)


def capacity(N: int, M: int, B: int, V: int, rps: int) -> int:
    """An upper bound on one launch's simd_sum calls (the grid's simdgroups x V x rows)."""
    tiles = -(-M // V) * -(-N // (2 * rps)) * B
    return tiles * 2 * V * rps


@dataclass(frozen=True)
class Sums:
    """One run's simd_sum calls, keyed: ``key`` is ((b * M) + m) * N + n per call."""

    key: np.ndarray  # int64 (calls,)
    lanes: np.ndarray  # uint32 bits (calls, 32)
    unconfirmed: int  # calls whose store or call count disagrees with their key
    padding: int  # calls for vectors past M: none from a kernel that skips them

    @staticmethod
    def concat(parts: list[Sums]) -> Sums:
        return Sums(
            np.concatenate([p.key for p in parts]),
            np.concatenate([p.lanes for p in parts]),
            sum(p.unconfirmed for p in parts),
            sum(p.padding for p in parts),
        )


def _first_row_and_rows(
    case: Any, fast: bool, out_row: np.ndarray, rps: int
) -> tuple[np.ndarray, ...]:
    if fast:
        return out_row, np.full_like(out_row, rps)
    first = out_row if case.N < 8 else np.minimum(case.N - 4, out_row)
    return first, np.minimum(4, case.N - first)


def keyed(
    case: Any,
    records: np.ndarray,
    y: np.ndarray,
    aux: np.ndarray,
    *,
    V: int,
    vector: tuple[int, int] | None = None,
    rps: int | None = None,
) -> Sums:
    """``records`` of one launch, keyed by the output element each call produces.

    ``V`` is the launch's vectors per threadgroup (1 for an M = 1 kernel, whose
    launch computes the single vector ``vector`` = (b, m)); ``y`` the launch's
    output as the kernel stored it, (B, M, N) or (1, 1, N); ``aux`` the global
    scale when the case has one; ``rps`` the launch's output tile (default the case's).
    """
    fast = case.fast
    tid = records["tid"].astype(np.int64)
    sg = records["simdgroup"].astype(np.int64)
    call = records["call"].astype(np.int64)
    rps = case.rps if rps is None else rps
    first, n_rows = _first_row_and_rows(case, fast, tid[:, 1] * 2 * rps + sg * rps, rps)
    v = tid[:, 0] * V + call // n_rows
    n = first + call % n_rows
    b = tid[:, 2]
    # Each simdgroup made one call per (real vector, row), numbered 0.. by the shim.
    where = np.concatenate([tid, sg[:, None]], axis=1)
    _, inverse, counts = np.unique(where, axis=0, return_inverse=True, return_counts=True)
    m = 1 if vector is not None else case.M
    vectors = np.minimum(V, m - tid[:, 0] * V)
    bad = counts[inverse.reshape(-1)] != vectors * n_rows
    stored = v < m
    if vector is not None:
        bad |= (b != 0) | (v != 0)
    # The result as the kernel stores it must be the element the key names.
    sums = records["out"]
    if case.hgs:
        sums = sums * (np.float32(aux.reshape(-1)[0]) / np.float32(GLOBAL_SCALE_DIVISOR))
    want = _bits(storage(sums.astype(np.float32), case.dtype))
    flat = y.reshape(-1, case.N)
    idx = np.where(stored & ~bad, (b * y.shape[1] + v) * case.N + n, 0)
    got = _bits(flat.reshape(-1)[idx])
    bad |= stored & (got != want)
    if vector is not None:
        b[:], v[:] = vector
    key = (b * case.M + v) * case.N + n
    keep = stored
    return Sums(
        key[keep],
        records["lanes"][keep].view(np.uint32),
        int((bad & keep).sum()),
        int((~stored).sum()),
    )


def _bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint16 if values.itemsize == 2 else np.uint32).astype(np.uint32)


def _per_element(s: Sums, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct input vectors per output element, one of them) for ``size`` elements."""
    rows = np.concatenate([s.key[:, None], s.lanes.astype(np.int64)], axis=1)
    distinct = np.unique(rows, axis=0)
    count = np.bincount(distinct[:, 0], minlength=size)
    lanes = np.zeros((size, 32), dtype=np.int64)
    lanes[distinct[:, 0]] = distinct[:, 1:]
    return count, lanes


@dataclass(frozen=True)
class Comparison:
    """simd_sum inputs of a candidate run against the M = 1 run, per output element."""

    elements: int  # output elements compared (B * M * N)
    differing: int  # elements whose 32 inputs differ, or that either run lacks
    unconfirmed: int  # calls (both runs) whose key the kernel's own store did not confirm
    calls: int  # the candidate's calls, padding included


def compare(reference: Sums, candidate: Sums, size: int) -> Comparison:
    """Every output element must get exactly one set of 32 inputs in each run, the same."""
    ref_count, ref_lanes = _per_element(reference, size)
    cand_count, cand_lanes = _per_element(candidate, size)
    same = (ref_count == 1) & (cand_count == 1) & (ref_lanes == cand_lanes).all(axis=1)
    return Comparison(
        elements=size,
        differing=int((~same).sum()),
        unconfirmed=reference.unconfirmed + candidate.unconfirmed,
        calls=len(candidate.key) + candidate.padding,
    )
