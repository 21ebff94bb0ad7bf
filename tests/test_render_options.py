"""Series and overlay carry the same kernel: every render option reaches both flavours."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from patchkit.carry import render


def _choices(field: dataclasses.Field) -> tuple[object, ...]:
    """Every value an option admits (the option axes of a render): a Literal's values, one
    backend at a time for ``backends``."""
    if field.name == "backends":
        return tuple((b,) for b in render.BACKENDS)
    if field.name == "with_required":
        return (True, False)
    hint = typing.get_type_hints(render.RenderOptions)[field.name]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()


OPTION_FIELDS = [f for f in dataclasses.fields(render.RenderOptions) if f.name != "flavour"]
OPTION_AXES = [(f.name, value) for f in OPTION_FIELDS for value in _choices(f)]


def test_every_option_has_an_axis() -> None:
    """An option this file cannot enumerate would go untested below: give it values here."""
    assert [f.name for f in OPTION_FIELDS if not _choices(f)] == []


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
    # The earlier changes' stages render fewer backends by design; the final render is here.
    monkeypatch.setattr(render, "render_stages", lambda *_a, **_k: [])
    render.render_all(lambda _path: "", options, render.TEMPLATES_DIR)
    flavours = {o.flavour for o in seen}
    assert flavours == {"upstream", "overlay"}
    for o in seen:
        assert getattr(o, name) == getattr(options, name), (o.flavour, name)


@pytest.mark.parametrize(
    ("flavour", "overlay", "renders"),
    [
        ("upstream", True, ["upstream", "overlay"]),  # the series and the overlay differ
        ("overlay", True, ["overlay"]),  # one flavour: rendered once, used for both
        ("upstream", False, ["upstream"]),  # export-pr: no overlay asked for
    ],
)
def test_each_flavour_is_rendered_once_per_file(
    flavour: str, overlay: bool, renders: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str]] = []

    def counting(plan, text, options, extra=None):
        seen.append((plan.path, options.flavour))
        return options.flavour

    monkeypatch.setattr(render, "render_file", counting)
    # Each earlier change's stage (one commit each) is its own render, of fewer backends.
    monkeypatch.setattr(render, "render_stages", lambda *_a, **_k: [])
    plans = render.selected_plans(render.DEFAULT_OPTIONS)
    options = render.RenderOptions(flavour=flavour)
    out = render.render_all(lambda _path: "", options, render.TEMPLATES_DIR, overlay=overlay)
    assert sorted(seen) == sorted((p.path, f) for p in plans for f in renders)
    assert set(out.patched.values()) == {flavour}
    assert set(out.overlay.values()) == ({"overlay"} if overlay else set())
