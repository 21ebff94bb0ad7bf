"""``patchkit probe``: block-versus-chain exactness of a real transformer verify forward.

Kernel parity is necessary, not sufficient: a verify forward also runs norms,
RoPE, attention and the LM head. This package builds a small quantized decoder
(:mod:`.model`), swaps its quantized linear between MLX's own and the streamed
kernel (:mod:`.linears`), compares a verify block with the chain of single-token
forwards byte for byte and isolates any differing op (:mod:`.exact`), times both
(:mod:`.speed`), and writes JSON + markdown (:mod:`.report`). MLX is imported
lazily, so ``import patchkit.verify.probe`` works without it.
"""

from __future__ import annotations

from patchkit.verify.probe.run import Options, run

__all__ = ["Options", "run"]
