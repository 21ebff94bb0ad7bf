"""CPU execution of MLX's Metal quantized kernels, and the bitwise parity suite.

The public entry points: :func:`pinned_header` (the pin's real ``quantized.h``
from the release-twin wheel, hash-checked), :func:`patched_header` (the
templates rendered onto a header text) and :func:`verify_header` (the suite,
used by ``patchkit rebase`` as its exactness gate).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from patchkit.carry import pin as pin_mod
from patchkit.carry import render, wheels
from patchkit.errors import BlobMismatchError, UserError
from patchkit.verify.emulate.suite import Verdict, verify_header

QUANTIZED_H = "mlx/backend/metal/kernels/quantized.h"

__all__ = [
    "QUANTIZED_H",
    "Verdict",
    "blob_sha",
    "patched_header",
    "pinned_file",
    "pinned_header",
    "verify_header",
]


def blob_sha(data: bytes) -> str:
    """The git blob id of ``data`` (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def pinned_file(pin: pin_mod.Pin, path: str) -> tuple[bytes, str]:
    """(bytes, where from) of upstream ``path`` at the pin, without the network.

    From the release-twin wheel when pin.toml records one (the cheap way: a
    wheel download once), else from patchkit's cached clone at the pinned
    commit, which every pin has after `patchkit apply` or `patchkit rebase`.
    """
    if pin.release:
        return wheels.header_path(pin.release, path).read_bytes(), f"mlx-cpu=={pin.release}"
    from patchkit.carry import source
    from patchkit.util import git

    clone = source.clone_dir(source.source_spec(None, pin.url))
    if not clone.exists() or git.blob_id(clone, pin.commit, path) is None:
        raise UserError(
            f"pin.toml records no release twin and no cached clone holds {pin.short}: "
            "run `patchkit apply` (it clones), or pass --header PATH"
        )
    return git.show_file(clone, pin.commit, path).encode(), f"the cached clone at {pin.short}"


def pinned_header(root: Path, header: Path | None = None) -> str:
    """The pin's upstream ``quantized.h``: ``header`` if given, else :func:`pinned_file`'s.

    Either way its blob hash must equal the one pin.toml records: running the
    suite on a different header would prove something about another tree.
    """
    pin = pin_mod.load(root / "pin.toml")
    expected = pin.blobs.get(QUANTIZED_H)
    if header is not None:
        data, source = header.read_bytes(), str(header)
    else:
        data, source = pinned_file(pin, QUANTIZED_H)
    actual = blob_sha(data)
    if actual != expected:
        raise BlobMismatchError(
            f"{QUANTIZED_H} from {source} is blob {actual}, pin.toml records {expected}; "
            "use the pinned release's header or re-pin with `patchkit rebase`"
        )
    return data.decode()


def patched_header(upstream_text: str, options: render.RenderOptions | None = None) -> str:
    """``upstream_text`` with the streamed kernels rendered in, exactly as `apply` would."""
    options = options or render.RenderOptions(backends=("metal",))
    plan = next(p for p in render.selected_plans(options) if p.path == QUANTIZED_H)
    return render.render_file(plan, upstream_text, options)
