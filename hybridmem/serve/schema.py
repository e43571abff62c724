"""The job schema as the page and OpenAPI read it, from `hybridmem.job.schema.FIELDS`.

Why: the page's form and the request's JSON schema are generated from the same declarations
as the CLI options, so a field added to the schema appears in both with its help and choices.
"""

from __future__ import annotations

from dataclasses import MISSING

from hybridmem.job import schema
from hybridmem.job.field import GROUPS
from hybridmem.serve.request import CONFIG_FORMATS, REQUEST_FIELDS

JSON_TYPES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _kind(key: str) -> str:
    """"list" for a tuple field, else the JSON type of the field's value."""
    tp = schema.TYPES[key]
    if "tuple" in str(tp):
        return "list"
    return JSON_TYPES[schema.value_type(tp)]


def _default(meta) -> object:
    d = meta.default
    if d is MISSING:
        return None
    return list(d) if isinstance(d, tuple) else d


def schema_view() -> dict:
    """Groups (key -> title, in order), the job fields (key, owner, group, type, help, choices,
    default, unit, required) and the request's other keys with their help."""
    from hybridmem.gpus import GPUS
    from hybridmem.models.loader import preset_names
    from hybridmem.predict import METHODS

    fields = [{"key": m.key, "name": m.name, "owner": m.owner, "group": m.group,
               "type": _kind(m.key), "help": m.help,
               "choices": None if m.choices is None else list(m.choices),
               "default": _default(m), "unit": m.unit, "required": m.default is MISSING}
              for m in schema.FIELDS]
    request = [{"key": k, "help": h} for k, h in REQUEST_FIELDS.items()]
    return {"groups": dict(GROUPS), "fields": fields, "request": request,
            "presets": list(preset_names()), "gpus": list(GPUS), "methods": list(METHODS),
            "config_formats": list(CONFIG_FORMATS)}


def _property(meta) -> dict:
    kind = _kind(meta.key)
    out: dict = ({"type": "array", "items": {"type": "string"}} if kind == "list"
                 else {"type": kind})
    out["description"] = meta.help
    if meta.choices is not None and kind != "list":
        out["enum"] = list(meta.choices)
    if meta.default is not MISSING:
        out["default"] = _default(meta)
    return out


def request_schema() -> dict:
    """The JSON schema of the `POST /v1/predict` body (OpenAPI at /docs)."""
    props = {m.key: _property(m) for m in schema.FIELDS if m.owner != "lora"}
    props["model"] = {"description": schema.BY_KEY["model"].help + " A preset, a preset's hub "
                      "id, or the config.json as an object (no path).",
                      "anyOf": [{"type": "string"}, {"type": "object"}]}
    props["lengths"] = {"description": "Per-sample token counts, inline (the server reads no "
                        "path): a list of integers, the text of a lengths file (one count per "
                        "line), or an object {tokens: samples}.",
                        "anyOf": [{"type": "array", "items": {"type": "integer"}},
                                  {"type": "string"}, {"type": "object"}]}
    props["lora"] = {"type": "object", "description": "LoRA settings (or lora_<name> keys)",
                     "properties": {m.name: _property(m) for m in schema.FIELDS
                                    if m.owner == "lora"}}
    for key, text in REQUEST_FIELDS.items():
        props[key] = {"description": text}
    props["gpu"]["type"] = props["method"]["type"] = props["recipe"]["type"] = "string"
    props["config"]["type"] = "string"
    props["config_format"].update(type="string", enum=list(CONFIG_FORMATS))
    for key in ("find_max_batch", "timeline", "every_gpu"):
        props[key].update(type="boolean", default=False)
    props["gpu_mem"]["type"] = "number"
    props["gpu_count"]["type"] = "integer"
    for key in ("deepspeed", "training_args", "quantization_config"):
        props[key]["type"] = "object"
    return {"type": "object", "properties": props,
            "example": {"model": "llava-1.5-7b", "micro_batch": 8, "seq_len": 2048,
                        "train": "llm+projector", "grad_ckpt": True,
                        "precision": "bf16-master", "gpu": "h100-80gb"}}
