"""A small Llama-style decoder in plain MLX, with a pluggable quantized linear.

Why our own model and not mlx-lm: the probe must control every op of the verify
forward (so a divergence can be pinned on one op), must swap the quantized
linear for the streamed JIT kernel, and must run on hosts that only have the
MLX wheels. The architecture is the common one: RMSNorm, RoPE, grouped-query
causal attention over a KV cache, SwiGLU MLP, an untied LM head whose vocabulary
(>= 32k) makes it a wide qmv. Weights are random from a seed and quantized with
``mx.quantize`` (group size 64), so runs are reproducible without downloads.

The KV cache is functional: a forward returns a new cache and never writes into
the one it was given, so the block and the chain can start from the very same
state object (and the probe still hashes it before each, to show it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GROUP_SIZE = 64


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of one decoder; presets in :data:`SIZES`."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    eps: float = 1e-5


SIZES = {
    # CPU tests: seconds. MLX's CPU quantized_matmul is slow in bfloat16 (~90 ms for a
    # 32k x 256 head), so the vocabulary is 4k here; it is still the widest linear.
    "tiny": ModelSpec(
        "tiny", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=4096
    ),
    # Llama-3.2-1B's shapes.
    "1b": ModelSpec(
        "1b", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256
    ),
    # Llama-3.2-3B's shapes.
    "3b": ModelSpec(
        "3b", hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=128256
    ),
}


@dataclass(frozen=True)
class QWeight:
    """One quantized weight (out x in) as ``mx.quantize`` returns it."""

    wq: Any
    scales: Any
    biases: Any
    bits: int
    out_dim: int
    in_dim: int
    group_size: int = GROUP_SIZE


Linear = Callable[[Any, QWeight], Any]  # (x of shape (M, in), weight) -> (M, out)


@dataclass
class Layer:
    """Weights of one block."""

    attn_norm: Any
    mlp_norm: Any
    q: QWeight
    k: QWeight
    v: QWeight
    o: QWeight
    gate: QWeight
    up: QWeight
    down: QWeight


@dataclass
class Model:
    """The whole decoder: spec, weights, and the dtype activations run in."""

    spec: ModelSpec
    bits: int
    dtype: Any
    embed: Any
    layers: list[Layer]
    final_norm: Any
    lm_head: QWeight
    # "fused": one sdpa call over the block (causal mask), as engines do today;
    # "per_query": the block's queries one at a time through the single-query call the
    # chain makes, so attention is the chain's arithmetic by construction (T calls a layer).
    attention: str = "fused"


def _mx() -> Any:
    import mlx.core as mx  # lazy: importing patchkit must not need MLX

    return mx


def _qweight(out_dim: int, in_dim: int, bits: int, dtype: Any) -> QWeight:
    """Random N(0, 1/in) weights, quantized; evaluated at once to bound peak memory."""
    mx = _mx()
    w = (mx.random.normal((out_dim, in_dim)) * (1.0 / math.sqrt(in_dim))).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=GROUP_SIZE, bits=bits)
    mx.eval(wq, s, b)
    return QWeight(wq, s, b, bits, out_dim, in_dim)


def _norm_weight(dim: int, dtype: Any) -> Any:
    """Near-1 norm gains, not exactly 1, so the multiply is a real rounding step."""
    mx = _mx()
    return (1.0 + 0.1 * mx.random.normal((dim,))).astype(dtype)


def build(spec: ModelSpec, bits: int, seed: int, dtype_name: str = "bfloat16") -> Model:
    """Random weights from ``seed``, every linear quantized at ``bits`` (group size 64)."""
    mx = _mx()
    mx.random.seed(seed)
    dtype = getattr(mx, dtype_name)
    d, qd, kvd = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    layers = [
        Layer(
            attn_norm=_norm_weight(d, dtype),
            mlp_norm=_norm_weight(d, dtype),
            q=_qweight(qd, d, bits, dtype),
            k=_qweight(kvd, d, bits, dtype),
            v=_qweight(kvd, d, bits, dtype),
            o=_qweight(d, qd, bits, dtype),
            gate=_qweight(spec.ffn, d, bits, dtype),
            up=_qweight(spec.ffn, d, bits, dtype),
            down=_qweight(d, spec.ffn, bits, dtype),
        )
        for _ in range(spec.layers)
    ]
    embed = mx.random.normal((spec.vocab, d)).astype(dtype)
    final = _norm_weight(d, dtype)
    head = _qweight(spec.vocab, d, bits, dtype)
    mx.eval(embed, final, [(ly.attn_norm, ly.mlp_norm) for ly in layers])
    return Model(spec, bits, dtype, embed, layers, final, head)


Cache = tuple[tuple[Any, Any], ...]  # per layer (keys, values), each (1, kv_heads, L, head_dim)


def empty_cache(model: Model) -> Cache:
    """A cache of length 0 for every layer."""
    mx = _mx()
    s = model.spec
    z = mx.zeros((1, s.kv_heads, 0, s.head_dim), dtype=model.dtype)
    return tuple((z, z) for _ in range(s.layers))


def cache_len(cache: Cache) -> int:
    """Positions already in the cache (the RoPE offset of the next token)."""
    return int(cache[0][0].shape[2])


@dataclass
class OpCall:
    """One op of a traced block forward: its output and how to recompute one position alone.

    ``single(i)`` recomputes position ``i`` the way a chain step would (M = 1 linear,
    one query row against the cache up to that position); ``axis`` is where positions
    lie in ``out``. Comparing the two isolates the op: both see the same inputs.
    """

    name: str
    layer: int
    out: Any
    single: Callable[[int], Any]
    axis: int = 0


@dataclass
class Trace:
    """Collects :class:`OpCall` records when given to :func:`forward`."""

    calls: list[OpCall] = field(default_factory=list)

    def add(self, name: str, layer: int, out: Any, single: Callable[[int], Any], axis: int = 0):
        self.calls.append(OpCall(name, layer, out, single, axis))


class _Ops:
    """The forward's ops, each recorded in the trace (if any) with its one-position recompute."""

    def __init__(self, model: Model, linear: Linear, trace: Trace | None, offset: int):
        self.m, self.lin, self.trace, self.offset = model, linear, trace, offset
        self.mx = _mx()

    def _rec(self, name: str, layer: int, out: Any, single: Callable[[int], Any], axis: int = 0):
        if self.trace is not None:
            self.trace.add(name, layer, out, single, axis)
        return out

    def norm(self, name: str, layer: int, x: Any, w: Any) -> Any:
        f = self.mx.fast.rms_norm
        eps = self.m.spec.eps
        return self._rec(name, layer, f(x, w, eps), lambda i: f(x[i : i + 1], w, eps))

    def linear(self, name: str, layer: int, x: Any, w: QWeight) -> Any:
        lin = self.lin
        return self._rec(name, layer, lin(x, w), lambda i: lin(x[i : i + 1], w))

    def rope(self, name: str, layer: int, x: Any) -> Any:
        s, off = self.m.spec, self.offset

        def f(t: Any, o: int) -> Any:
            return self.mx.fast.rope(
                t, s.head_dim, traditional=False, base=s.rope_theta, scale=1.0, offset=o
            )

        return self._rec(name, layer, f(x, off), lambda i: f(x[:, :, i : i + 1], off + i), 2)

    def attention(self, layer: int, q: Any, k: Any, v: Any) -> Any:
        sdpa = self.mx.fast.scaled_dot_product_attention
        scale = 1.0 / math.sqrt(self.m.spec.head_dim)
        t, off = q.shape[2], self.offset

        def single(i: int) -> Any:
            n = off + i + 1  # what a chain step sees: the cache up to and including itself
            return sdpa(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], scale=scale)

        if self.m.attention == "per_query" and t > 1:
            out = self.mx.concatenate([single(i) for i in range(t)], axis=2)
        else:
            out = sdpa(q, k, v, scale=scale, mask="causal" if t > 1 else None)

        return self._rec("attention", layer, out, single, 2)

    def swiglu(self, layer: int, g: Any, u: Any) -> Any:
        nn_silu = lambda a: a * self.mx.sigmoid(a)  # noqa: E731  (mlx.nn.silu's formula)
        return self._rec(
            "swiglu", layer, nn_silu(g) * u, lambda i: nn_silu(g[i : i + 1]) * u[i : i + 1]
        )


def _attention_block(ops: _Ops, li: int, ly: Layer, h: Any, kv: tuple[Any, Any]):
    """Pre-norm attention with RoPE and GQA; returns (residual output, new (keys, values))."""
    mx, s = ops.mx, ops.m.spec
    t = h.shape[0]
    xn = ops.norm("attn_norm", li, h, ly.attn_norm)
    q = ops.linear("q_proj", li, xn, ly.q).reshape(1, t, s.heads, s.head_dim)
    k = ops.linear("k_proj", li, xn, ly.k).reshape(1, t, s.kv_heads, s.head_dim)
    v = ops.linear("v_proj", li, xn, ly.v).reshape(1, t, s.kv_heads, s.head_dim)
    q = ops.rope("rope_q", li, q.transpose(0, 2, 1, 3))
    k = ops.rope("rope_k", li, k.transpose(0, 2, 1, 3))
    keys = mx.concatenate([kv[0], k], axis=2)
    values = mx.concatenate([kv[1], v.transpose(0, 2, 1, 3)], axis=2)
    a = ops.attention(li, q, keys, values)
    a = a.transpose(0, 2, 1, 3).reshape(t, s.heads * s.head_dim)
    return h + ops.linear("o_proj", li, a, ly.o), (keys, values)


def forward(
    model: Model, tokens: Any, cache: Cache, linear: Linear, trace: Trace | None = None
) -> tuple[Any, Cache]:
    """Logits (T, vocab) for ``tokens`` (T,) after ``cache``, and the extended cache.

    Lazy like any MLX code: nothing runs until the caller evaluates the result.
    """
    ops = _Ops(model, linear, trace, cache_len(cache))
    h = model.embed[tokens]
    new_cache = []
    for li, ly in enumerate(model.layers):
        h, kv = _attention_block(ops, li, ly, h, cache[li])
        new_cache.append(kv)
        xn = ops.norm("mlp_norm", li, h, ly.mlp_norm)
        g = ops.linear("gate_proj", li, xn, ly.gate)
        u = ops.linear("up_proj", li, xn, ly.up)
        h = h + ops.linear("down_proj", li, ops.swiglu(li, g, u), ly.down)
    last = model.spec.layers
    xn = ops.norm("final_norm", last, h, model.final_norm)
    return ops.linear("lm_head", last, xn, model.lm_head), tuple(new_cache)
