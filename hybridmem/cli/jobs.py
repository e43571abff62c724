"""`hybridmem predict --jobs FILE.jsonl`: one job per line, answered in order, each error in its row.

A line is the job with the schema's names, as the `job` object of `--json` gives it (`lora`
nested or `lora_<name>` flat, the parallel fields at the top level; its `warnings`, `sources`
and `defaults` are ignored, so an answer's job is a valid line), plus what is not a job field:
`gpu`, `gpu_mem`, `method`, `find_max_batch`, a `recipe`, the config files (`deepspeed`,
`training_args`, `peft_config`, `quantization_config`: a path or an object; `config`: a
launcher YAML's path, with `config_format`) and `zero_stage`. The model is a preset, a hub id,
a config.json path or a config.json object. The command line's job options are every line's
defaults; a line's own values win.

Why a line is priced by `answer.answer` like one `predict` call: the row of a job must equal
what `hybridmem predict --json` says of it; only the `sources` name the line instead of a flag.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.job import schema

LINE_FIELDS: tuple[str, ...] = ("gpu", "gpu_mem", "method", "find_max_batch")
"""Keys of a line that are not job fields and set how it is priced (the `predict` options)."""
FILE_FIELDS: tuple[str, ...] = ("recipe", "deepspeed", "training_args", "peft_config",
                                "quantization_config", "config", "config_format", "zero_stage")
"""Keys of a line that are `predict`'s file options (a path, or an object for the JSON ones)."""


def read_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of each job line: blank lines and `#` comments are skipped."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise SpecError("jobs", path, reason=err.strerror or "cannot be read") from None
    out = [(n, line) for n, line in enumerate(text.splitlines(), 1)
           if line.strip() and not line.lstrip().startswith("#")]
    if not out:
        raise SpecError("jobs", path, reason="holds no job (one JSON object per line)")
    return out


def line_values(data: object, where: str) -> tuple[dict, dict]:
    """A line's JSON -> (`predict`'s option values by schema key and file option, the
    `LINE_FIELDS` it sets)."""
    if not isinstance(data, dict):
        raise SpecError(where, type(data).__name__, reason="must be a JSON object")
    values: dict = {}
    how: dict = {}
    for key, value in data.items():
        if key in schema.JOB_EXTRAS:
            continue
        if key == "lora":
            if value is not None and not isinstance(value, dict):
                raise SpecError(f"{where}: lora", value, reason="must be an object or null")
            for name, setting in (value or {}).items():
                if f"lora_{name}" not in schema.BY_KEY:
                    raise SpecError(f"{where}: lora", name, sorted(
                        m.name for m in schema.FIELDS if m.owner == "lora"), reason="unknown field")
                values[f"lora_{name}"] = setting
        elif key == "model" and isinstance(value, dict):
            from hybridmem.models.loader import materialize_config

            values["model"] = materialize_config(json.dumps(value))
        elif key in schema.BY_KEY or key in FILE_FIELDS:
            values[key] = value
        elif key in LINE_FIELDS:
            how[key] = value
        else:
            import difflib

            valid = sorted({*schema.BY_KEY, "lora", *FILE_FIELDS, *LINE_FIELDS})
            near = difflib.get_close_matches(key, valid, n=1)
            raise SpecError(where, key, valid, reason="unknown field"
                            + (f", did you mean {near[0]!r}?" if near else ""))
    if isinstance(values.get("peft_config"), str) and values["peft_config"].lstrip().startswith("{"):
        values["peft_config"] = json.loads(values["peft_config"])  # the job echo's JSON text
    return values, how


def price_line(item: dict) -> dict:
    """One line's answer (`hybridmem predict --json`'s object): `item` holds the line's text,
    its name for sources (`where`), the command line's values (`base`) and pricing options
    (`how`). Module-level so that it pickles to a worker (`hybridmem.fanout`)."""
    from hybridmem.answer import answer, resolve_gpu, resolve_job

    where = item["where"]
    try:
        data = json.loads(item["text"])
    except json.JSONDecodeError as err:
        raise SpecError(where, item["text"][:60], reason=f"not JSON: {err.msg}") from None
    values, how = line_values(data, where)
    if "gpu" in how or "gpu_mem" in how:  # a line's GPU replaces the command line's
        how = {"gpu": None, "gpu_mem": None, **how}
    how = {**item["how"], **how}
    resolved, warnings = resolve_job({**item["base"], **values})
    sources = {key: f"{where}: {key}" if key in values and src.startswith("flag ") else src
               for key, src in resolved.sources.items()}
    resolved = type(resolved)(resolved.spec, sources)
    found = answer(resolved, warnings, resolve_gpu(how.get("gpu"), how.get("gpu_mem")),
                   method=how.get("method"), find_max_batch=bool(how.get("find_max_batch")))
    return found.to_dict()


def run_jobs(path: str, base: dict, how: dict, workers: int | None) -> list[dict]:
    """Every line of `path` priced (`price_line`) in `workers` processes, in order; each row
    carries its `line` number, an answer or its one-line `error`."""
    from hybridmem.fanout import price_many

    name = Path(path).name
    lines = read_lines(path)
    items = [{"text": text, "where": f"{name} line {n}", "base": base, "how": how}
             for n, text in lines]
    rows = price_many(price_line, items, workers)
    return [{"line": n, **row} for (n, _), row in zip(lines, rows)]


GiB = 2**30


def row_text(row: dict) -> str:
    """A console line for one row: the job in a few words, the device peak, the verdict."""
    if "error" in row:
        return f"{row['line']:>5}  error: {row['error']}"
    job = row["job"]
    parts = [job["model"], f"mb={job['micro_batch']}", f"seq={job['seq_len']}", job["train"],
             job["precision"] or "custom"]
    if job["world_size"] > 1:
        parts.append(f"{job['world_size']}x {job['strategy']}")
    peak = row["peak"]["device_bytes"] / GiB
    fit = "" if row.get("fit") is None else f"  fits {row['gpu']['name']}: {row['fit']}"
    return f"{row['line']:>5}  {' '.join(map(str, parts))}: {peak:.2f} GiB device ({row['method']}){fit}"
