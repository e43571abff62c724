"""Errors raised at the boundary: one line naming the field, the value and the valid choices.

The CLI turns a `SpecError` into that line on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


VALUE_CHARS = 120
"""Longest value an error quotes whole: a whole file's content (a nested array where a name was
expected) would make the one line thousands of characters long."""


def shown_value(value: object) -> str:
    """`repr(value)`, cut to `VALUE_CHARS` with the full length said."""
    text = repr(value)
    if len(text) <= VALUE_CHARS:
        return text
    return f"{text[:VALUE_CHARS - 20]}... ({len(text)} characters)"


class SpecError(ValueError):
    """Bad user input. `str(err)` is the one-line message shown to the user."""

    def __init__(self, field: str, value: object, choices: Iterable[object] | str | None = None,
                 reason: str | None = None) -> None:
        self.field = field
        self.value = value
        if choices is None or isinstance(choices, str):
            self.choices = choices
        else:
            self.choices = ", ".join(str(c) for c in choices)
        self.reason = reason
        msg = f"{field}={shown_value(value)}"
        msg += f": {reason}" if reason else " is not valid"
        if self.choices:
            msg += f" (valid: {self.choices})"
        super().__init__(msg)


class UnsupportedModelError(SpecError):
    """The model's code cannot be handled by a tier (e.g. cannot run under fake tensors)."""
