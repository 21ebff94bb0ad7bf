"""CPU execution of MLX's Metal quantized kernels, and the bitwise parity suite.

One emulator over a table of kernel families (:mod:`.families`: affine on
``quantized.h``; mxfp4, nvfp4 and mxfp8 on ``fp_quantized.h``). The public
entry points: :func:`pinned_sources` (the pin's real kernel header and its
type headers, from the release-twin wheel, hash-checked), :func:`patched` (the
templates rendered onto a header text), and the suites :func:`verify_header`
and :func:`verify_fp_header` (``patchkit rebase``'s exactness gates), with
the affine/fp shorthands :func:`pinned_header`, :func:`pinned_fp_headers`,
:func:`patched_header` and :func:`patched_fp_header`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from patchkit.carry import pin as pin_mod
from patchkit.carry import render, wheels
from patchkit.errors import BlobMismatchError, UserError
from patchkit.verify.emulate.extract import Sources
from patchkit.verify.emulate.families import AFFINE, FP, Header
from patchkit.verify.emulate.suite import Verdict, verify_fp_header, verify_header

QUANTIZED_H = AFFINE.path
FP_QUANTIZED_H = FP.path

__all__ = [
    "FP_QUANTIZED_H",
    "QUANTIZED_H",
    "Sources",
    "Verdict",
    "blob_sha",
    "patched",
    "patched_fp_header",
    "patched_header",
    "pinned_file",
    "pinned_fp_headers",
    "pinned_header",
    "pinned_sources",
    "sources",
    "verify_fp_header",
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


def pinned_sources(
    root: Path, family: Header, header: Path | None = None
) -> tuple[str, tuple[str, ...]]:
    """The pin's upstream kernel header of ``family`` and its type headers' texts.

    ``header`` names the kernel header, with the type headers beside it; by
    default all come from :func:`pinned_file`. Either way the kernel header's
    blob hash must equal the one pin.toml records: running the suite on a
    different header would prove something about another tree.
    """
    pin = pin_mod.load(root / "pin.toml")
    expected = pin.blobs.get(family.path)
    if header is None:
        data, source = pinned_file(pin, family.path)
    else:
        data, source = header.read_bytes(), str(header)
    actual = blob_sha(data)
    if actual != expected:
        raise BlobMismatchError(
            f"{family.path} from {source} is blob {actual}, pin.toml records {expected}; "
            "use the pinned release's header or re-pin with `patchkit rebase`"
        )
    if header is None:
        types = tuple(pinned_file(pin, p)[0].decode() for p in family.type_headers)
    else:
        types = tuple((header.parent / Path(p).name).read_text() for p in family.type_headers)
    return data.decode(), types


def pinned_header(root: Path, header: Path | None = None) -> str:
    """The pin's upstream ``quantized.h`` (:func:`pinned_sources` for affine)."""
    return pinned_sources(root, AFFINE, header)[0]


def pinned_fp_headers(root: Path, header: Path | None = None) -> tuple[str, tuple[str, ...]]:
    """The pin's ``fp_quantized.h`` and its ``fp4.h`` / ``fp8.h`` texts (:func:`pinned_sources`)."""
    return pinned_sources(root, FP, header)


def patched(upstream_text: str, family: Header, options: render.RenderOptions | None = None) -> str:
    """``upstream_text`` (``family``'s header) with our kernels rendered in, as `apply` would."""
    options = options or render.RenderOptions(backends=("metal",))
    plan = next(p for p in render.selected_plans(options) if p.path == family.path)
    return render.render_file(plan, upstream_text, options)


def sources(upstream_text: str, family: Header) -> Sources:
    """``family``'s header as the tree has it and patched: what the parity suite compiles."""
    return Sources(upstream_text, patched(upstream_text, family))


def patched_header(upstream_text: str, options: render.RenderOptions | None = None) -> str:
    """``upstream_text`` (``quantized.h``) with the affine streamed kernels rendered in."""
    return patched(upstream_text, AFFINE, options)


def patched_fp_header(upstream_text: str, options: render.RenderOptions | None = None) -> str:
    """``upstream_text`` (``fp_quantized.h``) with the fp streamed kernels rendered in."""
    return patched(upstream_text, FP, options)
