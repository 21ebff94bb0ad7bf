"""Series and overlay carry the same kernel: every render option reaches both flavours."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from patchkit.carry import render, workspace


def _choices(field: dataclasses.Field) -> tuple[object, ...]:
    """Every value a Literal-typed option admits (the option axes of a render)."""
    hint = typing.get_type_hints(render.RenderOptions)[field.name]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()


OPTION_AXES = [
    (f.name, value)
    for f in dataclasses.fields(render.RenderOptions)
    if f.name not in ("backends", "flavour")
    for value in _choices(f)
] + [  # the options that are not a Literal: a value other than the default
    ("cuda_split_tail", False),
    ("cuda_stream_min_weights", 0),
    ("cuda_stream_min_weights", 1 << 20),
    ("cuda_rows_per_warp", 1),
    ("cuda_async_tail", True),
    ("cuda_min_blocks_per_sm", 4),
]


@pytest.mark.parametrize(("name", "value"), OPTION_AXES)
def test_overlay_options_keep_every_field_but_the_flavour(
    name: str, value: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[render.RenderOptions] = []

    def spy_render_file(plan, text, options, extra=None):
        seen.append(options)
        return text or ""

    options = dataclasses.replace(render.RenderOptions(), **{name: value})
    monkeypatch.setattr(render, "render_file", spy_render_file)
    workspace.render_all(lambda _path: "", options, render.TEMPLATES_DIR)
    flavours = {o.flavour for o in seen}
    assert flavours == {"upstream", "overlay"}
    for o in seen:
        assert getattr(o, name) == value, (o.flavour, name)
