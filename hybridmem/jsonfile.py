"""Reading a JSON object a user points at (a model config, a BitsAndBytesConfig, a DeepSpeed or
TrainingArguments file, an adapter_config.json, an HTTP request body): one home for the
one-line errors, importable from every layer.

Why a nesting limit: Python's `json` decoder recurses once per `[` / `{` and raises
`RecursionError` near the interpreter's recursion limit (1000 frames by default), and the
readers that walk a parsed config (deep copies, key checks, pydantic) recurse too. No format
these readers take nests deeper than a handful of levels (a DeepSpeed config's
`zero_optimization.offload_param` is 3; a VLM config.json's `text_config.rope_scaling` is 3),
so a document deeper than `MAX_DEPTH` is refused with one line before any of them sees it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridmem.errors import SpecError

MAX_DEPTH = 64
"""Deepest nesting of arrays / objects accepted: far above any config format read here (see
the module docstring), far below Python's default recursion limit of 1000 frames
(`sys.getrecursionlimit`), which the readers' own recursion shares."""


def depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text, counted without recursion (brackets inside
    strings skipped), so a hostile document cannot exhaust the stack before it is refused."""
    deepest = level = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    return deepest


def parse_json(text: str | bytes, field: str, value: object) -> object:
    """`json.loads(text)`, or a one-line SpecError naming `field` and `value` (the file or
    the body): not UTF-8, malformed, or nested deeper than `MAX_DEPTH`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(field, value, reason="cannot read it (not UTF-8 text)") from None
    if "[" in text or "{" in text:  # the scan costs a pass over the text; skip it for scalars
        deepest = depth(text)
        if deepest > MAX_DEPTH:
            raise SpecError(field, value, reason=f"JSON nested {deepest} levels deep (at most "
                            f"{MAX_DEPTH}: no config format nests deeper)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(field, value,
                        reason=f"malformed JSON at line {err.lineno} col {err.colno}: {err.msg}"
                        ) from None
    except ValueError as err:  # an integer of more than 4300 digits: Python's int-from-text
        # limit (sys.set_int_max_str_digits), which json.loads raises as a plain ValueError
        raise SpecError(field, value, reason=f"malformed JSON ({str(err).splitlines()[0][:120]})"
                        ) from None
    except RecursionError:  # nesting within MAX_DEPTH never gets here; kept as the last guard
        raise SpecError(field, value, reason="JSON nested too deeply") from None


def check_depth(data: object, field: str, value: object) -> None:
    """A one-line SpecError when parsed data (a YAML config's) nests deeper than `MAX_DEPTH`,
    walked without recursion."""
    stack = [(data, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else \
            item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if level + 1 > MAX_DEPTH:
                    raise SpecError(field, value, reason=f"nested more than {MAX_DEPTH} levels "
                                    "deep (no config format nests deeper)")
                stack.append((child, level + 1))


def read_json_text(path: str | Path, field: str) -> str:
    """The text of a file a user named, or a one-line SpecError naming `field`."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(field, str(path), reason="file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise SpecError(field, str(path), reason=f"cannot read it ({reason})") from None


def read_json_object(path: str | Path, field: str) -> dict:
    """A JSON object from a file, or a one-line SpecError naming `field` (every JSON input)."""
    data = parse_json(read_json_text(path, field), field, str(path))
    if not isinstance(data, dict):
        raise SpecError(field, str(path), reason="config JSON must be an object")
    return data
