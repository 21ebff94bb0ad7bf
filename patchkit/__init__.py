"""patchkit: carry an order-preserving streamed qmv over a pinned MLX commit."""

__version__ = "0.1.0"
