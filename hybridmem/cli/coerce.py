"""Option values of a plain type (str, int, float, bool) coerced without pydantic.

typer 0.2x coerces every option value, the unset ones (None) included, through a pydantic
`TypeAdapter` built per option (`typer._coercion.build_runtime_param`): for `predict`'s ~50
options that is importing pydantic and building ~50 adapters, about as long as the analytic
answer itself. A value that is None, or a string that Python's `int` / `float` and pydantic's
lax mode read alike (plain decimal digits), is coerced here to the same value; anything else
goes to typer's own coercion, so a bad value gets typer's message. Options of other shapes,
and typer releases without this runtime layer, are left to typer.
"""

from __future__ import annotations

import re

from typer.core import TyperGroup

PLAIN: dict[type, re.Pattern | None] = {
    str: None,
    bool: None,
    int: re.compile(r"-?[0-9]+"),
    float: re.compile(r"-?[0-9]+(?:\.[0-9]+)?"),
}
"""Annotation -> the strings converted with the type itself (str: every string; bool: only
None here, typer passes a parsed flag through as is)."""


class PlainCoercion:
    """A stand-in for typer's `RuntimeParam` of one option (its `coerce` contract)."""

    __slots__ = ("annotation",)

    def __init__(self, annotation: type) -> None:
        self.annotation = annotation

    def coerce(self, value, param, ctx):
        if value is None:
            return None
        if isinstance(value, str):
            if self.annotation is str:
                return value
            pattern = PLAIN[self.annotation]
            if pattern is not None and pattern.fullmatch(value):
                return self.annotation(value)
        from typer._coercion import build_runtime_param  # typer's own, with its messages

        return build_runtime_param(param.type_descriptor).coerce(value, param=param, ctx=ctx)


def install(params) -> None:
    """Give each plain single-value option of `params` a `PlainCoercion` (before parsing)."""
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if descriptor is None or getattr(param, "_runtime_param", False) is not None:
            continue  # not typer's runtime layer, or already set
        info = descriptor.parameter_info
        if (descriptor.annotation in PLAIN and descriptor.file_annotation is None
                and not param.multiple and param.nargs == 1
                and getattr(info, "parser", None) is None
                and getattr(info, "click_type", None) is None
                and getattr(info, "min", None) is None and getattr(info, "max", None) is None):
            param._runtime_param = PlainCoercion(descriptor.annotation)


class PlainGroup(TyperGroup):
    """The `hybridmem` group, whose own options (`--help`) are coerced by `install` too."""

    def parse_args(self, ctx, args):
        install(self.get_params(ctx))
        return super().parse_args(ctx, args)
