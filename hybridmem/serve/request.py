"""A `POST /v1/predict` body -> the values `hybridmem predict` would get, refusing every path.

The body is the job with the schema's names (the `job` object of `--json`: `lora` nested or
`lora_<name>` flat, the parallel fields at the top level; its `warnings` / `sources` /
`defaults` are ignored, so an answer's job posts back as is), plus what is not a job field:
`gpu` / `gpu_mem`, `gpu_count` (= `world_size`), `method`, `find_max_batch`, a `recipe` name,
and config files given inline, never by path: `config` (a LLaMA-Factory / axolotl / torchtune
YAML, a TrainingArguments or DeepSpeed JSON, as text), `deepspeed`, `training_args`,
`peft_config` and `quantization_config` (objects). The model is a preset, a preset's hub id or
a `config.json` object, and `lengths` the per-sample token counts themselves (a list, the text
of a lengths file, or an object length -> samples); both are written to the server's own
folder, the one place the readers open.

Why no path: the service may be reachable by others, and a path would let a request make the
server read any file it can (`/etc/passwd` parsed as a lengths file, its first line quoted back
in the error). Every body key and every config key a reader follows to a file is in
docs/serve.md's audit; `FILE_KEYS` are refused at any depth of a pasted config.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.intake.dialects import DIALECTS
from hybridmem.job import options, schema
from hybridmem.job.field import check_value
from hybridmem.jsonfile import parse_json

REQUEST_FIELDS: dict[str, str] = options.API_FIELDS
"""Body keys that are not job fields -> their one-line help (the OpenAPI schema and the page),
declared once with the CLI's (`hybridmem.job.options`)."""

CONFIG_FORMATS: tuple[str, ...] = (*DIALECTS, "training_args", "deepspeed")
"""`--config-format`'s dialects (`intake.dialects.DIALECTS`) and the two JSON files."""
CONFIG_NAMES: dict[str, str] = {"training_args": "training_args.json",
                                "deepspeed": "deepspeed.json"}
"""How the sources and warnings name pasted text (a launcher's YAML: `config.yaml`)."""
# DeepSpeed's own top-level keys (deepspeed/runtime/constants.py) that tell a pasted DeepSpeed
# JSON from a TrainingArguments one
DEEPSPEED_MARKERS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size")
FILE_KEYS = ("deepspeed", "fsdp_config", "deepspeed_config_file")
"""Keys of a launcher YAML or TrainingArguments whose string value is a file a reader opens
(TrainingArguments / LLaMA-Factory / axolotl `deepspeed`, TrainingArguments `fsdp_config`,
accelerate's `deepspeed_config.deepspeed_config_file`), refused at any depth."""
INLINE_SAMPLES = 1 << 20
"""Most samples a `lengths` histogram may expand to (a list or a text is held to the body cap;
a histogram's counts are not): a million samples price a dataset's distribution."""
LENGTHS_HELP = ("a list of token counts, the text of a lengths file (one count per line, or "
                "separated by commas or spaces), or an object {tokens: samples}")
MODEL_KEYS = ("model_name_or_path", "base_model")
"""Launcher keys that name the model (LLaMA-Factory's, axolotl's)."""
KINDS: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number",
                          str: "text"}
JOB_NAMES: frozenset[str] = frozenset(
    {m.name for m in schema.FIELDS if m.owner != "lora"} | {"lora"}
    | {m.key for m in schema.FIELDS if m.owner == "lora"})


@dataclass
class Job:
    """A request as `hybridmem predict`'s option values (`hybridmem.answer.resolve_job`)."""

    values: dict = field(default_factory=dict)
    gpu: str | None = None
    gpu_mem: float | None = None
    method: str | None = None
    find_max_batch: bool = False
    timeline: bool = False
    every_gpu: bool = False


def preset_model(value: object, where: str = "model") -> str:
    """`value` when it is a preset or a preset's hub id; anything else (a path) is refused."""
    from hybridmem.models.hub import preset_for
    from hybridmem.models.loader import preset_names

    if isinstance(value, str) and (value in preset_names() or preset_for(value) is not None):
        return value
    raise SpecError(where, value, reason="not a preset (GET /v1/models) or a preset's hub id; "
                    "the server reads no path: send the config.json as an object")


def inline_model(data: dict, folder: Path) -> str:
    """A config.json object written to `folder/<its hash>/config.json`; that path."""
    text = json.dumps(data, sort_keys=True)
    if "model_type" not in data:
        raise SpecError("model", "{...}", reason="a config.json object needs its model_type")
    path = folder / hashlib.sha256(text.encode()).hexdigest()[:16] / "config.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return str(path)


def _typed(meta, value: object) -> object:
    """`value` checked against the field's type (JSON gives typed values; a list or a comma
    string for a tuple field); the spec checks ranges and choices."""
    tp = schema.TYPES[meta.key]
    plain = schema.value_type(tp)
    text = str(tp)
    if value is None:
        return None
    if "tuple" in text:
        if isinstance(value, str) or (isinstance(value, list)
                                      and all(isinstance(v, str) for v in value)):
            return schema.parse_cli(meta, value)
        raise SpecError(meta.key, value, reason="must be a list of names or a comma-separated string")
    if plain is bool:
        ok = isinstance(value, bool)
    elif plain is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif plain is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str) or ("int" in text and isinstance(value, int)
                                         and not isinstance(value, bool))
    if not ok:
        raise SpecError(meta.key, value, meta.choices, reason=f"must be {KINDS[plain]}")
    check_value(meta, value, meta.key)  # the schema's bound, before the model is looked at
    return value


def _object(value: object, key: str) -> dict:
    if isinstance(value, dict):
        return value
    raise SpecError(key, value if not isinstance(value, str) else value[:80],
                    reason="must be a JSON object (the server reads no path)")


def _no_file_paths(cfg: dict, where: str, deepspeed: dict | None = None) -> dict:
    """`cfg` with a top-level DeepSpeed path replaced by the request's `deepspeed` object; any
    other file path (a `FILE_KEYS` value at any depth, a model) is refused."""
    cfg = dict(cfg)
    if isinstance(cfg.get("deepspeed"), str) and cfg["deepspeed"] and deepspeed is not None:
        cfg["deepspeed"] = deepspeed
    _refuse_paths(cfg, where)
    for key in MODEL_KEYS:
        if key in cfg:
            preset_model(cfg[key], f"{where}: {key}")
    return cfg


def _refuse_paths(value: object, where: str) -> None:
    """A SpecError for the first `FILE_KEYS` key holding a string, anywhere in `value` (walked
    without recursion: a pasted config may nest deeply)."""
    todo = [(value, where)]
    while todo:
        node, at = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for key, child in items:
            name = f"{at}: {key}" if at == where else f"{at}.{key}"
            if key in FILE_KEYS and isinstance(child, str) and child:
                raise SpecError(name, child[:80], reason="the server reads no path a config "
                                "names: put the JSON object under this key (or send "
                                "`deepspeed`)")
            if isinstance(child, (dict, list)):
                todo.append((child, name))


def inline_lengths(value: object, folder: Path) -> str:
    """The request's `lengths` (`LENGTHS_HELP`) written as a lengths file to
    `folder/<its hash>.txt`; that path. A string that is not counts is refused as a path
    would be, with nothing opened."""
    from hybridmem.batches.read import MAX_TOKENS, token_counts

    if isinstance(value, str):
        words = value.replace(",", " ").split()  # a file's lines, or "512, 1024" from a form
        if not words or any(not (w.isascii() and w.isdigit()) for w in words):
            raise SpecError("lengths", value[:80], reason="the server reads no path; send "
                            f"the counts inline: {LENGTHS_HELP}")
        counts = token_counts("\n".join(words), "lengths").tolist()
    elif isinstance(value, list):
        if not value or any(isinstance(v, bool) or not isinstance(v, int)
                            or not 1 <= v <= MAX_TOKENS for v in value):
            raise SpecError("lengths", "[...]", reason=f"a list of token counts from 1 to "
                            f"{MAX_TOKENS}")
        counts = value
    elif isinstance(value, dict):
        counts = _histogram(value, MAX_TOKENS)
    else:
        raise SpecError("lengths", type(value).__name__, reason=f"must be {LENGTHS_HELP}")
    text = "".join(f"{n}\n" for n in counts)
    path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.txt"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return str(path)


def _histogram(value: dict, most_tokens: int) -> list[int]:
    """{tokens: samples} (keys as JSON gives them, text) -> the counts, shortest first."""
    pairs, total = [], 0
    for key, samples in value.items():
        tokens = key.strip() if isinstance(key, str) else ""
        if not (tokens.isascii() and tokens.isdigit()) or not 1 <= int(tokens[:14]) <= most_tokens \
                or isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise SpecError("lengths", str(key)[:40], reason="a histogram maps a token count "
                            f"(1 to {most_tokens}) to a number of samples (0 or more)")
        total += samples
        if total > INLINE_SAMPLES:
            raise SpecError("lengths", "{...}", reason=f"more than {INLINE_SAMPLES} samples")
        pairs.append((int(tokens), samples))
    if total == 0:
        raise SpecError("lengths", "{...}", reason="the histogram has no samples")
    return [tokens for tokens, samples in sorted(pairs) for _ in range(samples)]


def _config(text: object, config_format: object, deepspeed: dict | None,
            folder: Path) -> dict:
    """The values a pasted config sets: `config` (a launcher's, read), or `training_args` /
    `deepspeed` (a JSON of those)."""
    from hybridmem.intake.dialects import DIALECTS, detect, read_mapping
    from hybridmem.intake.dialects.common import parse_yaml

    if not isinstance(text, str):
        raise SpecError("config", type(text).__name__, reason="must be the config's text")
    if config_format is not None and config_format not in CONFIG_FORMATS:
        raise SpecError("config_format", config_format, CONFIG_FORMATS)
    own = getattr(DIALECTS.get(config_format), "parse", None)  # torchtitan TOML, Megatron args
    cfg = own(text, "config") if own is not None else parse_yaml(text, "config")  # YAML reads JSON too
    kind = config_format
    if kind is None:
        try:
            kind = detect(cfg, "config")
        except SpecError:  # no launcher's keys: a JSON of a Trainer run or of DeepSpeed
            kind = "deepspeed" if any(k in cfg for k in DEEPSPEED_MARKERS) else "training_args"
    if kind == "deepspeed":
        return {"deepspeed": cfg}
    where = CONFIG_NAMES.get(kind, "config.yaml")
    cfg = _no_file_paths(cfg, where, deepspeed)
    if kind == "training_args":
        return {"training_args": cfg}
    # relative paths resolve beside the config: an empty folder of the server's own
    return {"config": read_mapping(cfg, where, folder / "none", kind)}


def parse_body(body: object, folder: Path) -> Job:
    """The request body -> a `Job`; bad input is a SpecError naming the field, the value and
    the valid choices. `folder`: the server's own folder for inline config.json objects."""
    if not isinstance(body, dict):
        raise SpecError("body", type(body).__name__, reason="must be a JSON object")
    unknown = [k for k in body if k not in JOB_NAMES and k not in REQUEST_FIELDS
               and k not in schema.JOB_EXTRAS]
    if unknown:
        valid = sorted(JOB_NAMES | set(REQUEST_FIELDS))
        near = difflib.get_close_matches(unknown[0], valid, n=1)
        raise SpecError("body", unknown[0], valid, reason="unknown field"
                        + (f", did you mean {near[0]!r}?" if near else ""))
    job = Job()
    values: dict = {}
    lora = body.get("lora")
    if lora is not None:
        if not isinstance(lora, dict):
            raise SpecError("lora", lora, reason="must be an object or null")
        for name, value in lora.items():
            if f"lora_{name}" not in schema.BY_KEY:
                raise SpecError("lora", name, sorted(m.name for m in schema.FIELDS
                                                     if m.owner == "lora"), reason="unknown field")
            values[f"lora_{name}"] = value
    for key, value in body.items():
        if key in schema.BY_KEY and key not in ("peft_config", "model", "lengths"):
            values[key] = value
    for key, value in list(values.items()):
        values[key] = _typed(schema.BY_KEY[key], value)
    if body.get("lengths") is not None:
        values["lengths"] = inline_lengths(body["lengths"], folder / "lengths")
    if isinstance(body.get("model"), dict):
        values["model"] = inline_model(body["model"], folder / "models")
    elif body.get("model") is not None:
        values["model"] = preset_model(body["model"])
    if "gpu_count" in body and body["gpu_count"] is not None:
        count = _typed(schema.BY_KEY["world_size"], body["gpu_count"])
        if values.get("world_size") not in (None, count):
            raise SpecError("gpu_count", count, [values["world_size"]],
                            reason="differs from world_size")
        values["world_size"] = count
    deepspeed = None
    if body.get("deepspeed") is not None:
        deepspeed = values["deepspeed"] = _object(body["deepspeed"], "deepspeed")
    if body.get("training_args") is not None:
        values["training_args"] = _no_file_paths(
            _object(body["training_args"], "training_args"), "training_args", deepspeed)
    peft = body.get("peft_config")
    if isinstance(peft, str):  # the `job` echo's canonical JSON text
        try:
            peft = parse_json(peft, "peft_config", peft[:80])
        except SpecError as err:
            raise SpecError("peft_config", peft[:80], reason=f"{err.reason} (the server reads "
                            "no path: send the adapter_config.json object)") from None
    if peft is not None:
        values["peft_config"] = _object(peft, "peft_config")
    if body.get("quantization_config") is not None:
        values["quantization_config"] = _object(body["quantization_config"],
                                                "quantization_config")
    if body.get("recipe") is not None:
        values["recipe"] = body["recipe"]
    if body.get("config") is not None:
        values.update(_config(body["config"], body.get("config_format"), deepspeed, folder))
    elif body.get("config_format") is not None:
        raise SpecError("config_format", body["config_format"], reason="needs config (its text)")
    job.values = values
    job.gpu, job.gpu_mem, job.method = body.get("gpu"), body.get("gpu_mem"), body.get("method")
    for key, kind in (("gpu", str), ("method", str), ("gpu_mem", (int, float))):
        value = getattr(job, key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise SpecError(key, value, reason="wrong type")
    for key in ("find_max_batch", "timeline", "every_gpu"):
        flag = body.get(key, False)
        if not isinstance(flag, bool):
            raise SpecError(key, flag, [True, False])
        setattr(job, key, flag)
    return job
