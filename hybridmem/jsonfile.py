"""Reading a JSON object a user points at (a model config, a BitsAndBytesConfig, a DeepSpeed or
TrainingArguments file): one home for the one-line errors, importable from every layer."""

from __future__ import annotations

import json
from pathlib import Path

from hybridmem.errors import SpecError


def read_json_object(path: str | Path, field: str) -> dict:
    """A JSON object from a file, or a one-line SpecError naming `field` (every JSON input)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(field, str(path), reason="file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise SpecError(field, str(path), reason=f"cannot read it ({reason})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(field, str(path),
                        reason=f"malformed JSON at line {err.lineno} col {err.colno}: {err.msg}") from None
    if not isinstance(data, dict):
        raise SpecError(field, str(path), reason="config JSON must be an object")
    return data
