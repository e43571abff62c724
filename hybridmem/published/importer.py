"""The generic importer: JSON-lines records -> adapter -> dataset rows (`source="published"`).

Every record becomes one row: `ok` when its job is a `TrainingSpec`, `excluded` (with
`excluded_reason`) when it is not representable yet; nothing is dropped. A row's identity is
its `measurement_id` (the record id): re-importing a file adds only ids the dataset lacks, and
the reader keeps one row per id. The new rows are written as one part file through the store
(atomic rename), so a killed import leaves the dataset as it was or with every new row.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.harness import store
from hybridmem.harness.schema import SCHEMA_VERSION

SOURCE = "published"
ADAPTERS: dict[str, str] = {"peft-metamathqa": "hybridmem.published.peft_metamathqa",
                            "qwen-profiling": "hybridmem.published.qwen_profiling"}
"""`--from` name -> adapter module (defines `NAME`, `VERSION` and `row(record) -> dict`)."""
DEFAULT_OUT = Path("datasets") / "published"

# Columns every published row shares: no device (NVML) figure, no per-phase peaks, one process.
COMMON: dict[str, object] = {
    "images_per_sample": 0, "image_size": 0, "image_tokens": 0, "world_size": 1,
    "strategy": "none", "device_source": "none", "phase_peaks_json": "[]",
    "rank_peaks_json": "", "driver_version": "", "alloc_conf": "", "hostname": "",
    "history_path": "", "error": "",
}


@dataclass
class ImportReport:
    source: str
    path: str
    out: Path
    records: int
    added: int = 0
    already_present: int = 0
    outcomes: Counter = field(default_factory=Counter)
    """Outcomes of the rows added now."""
    excluded: Counter = field(default_factory=Counter)
    """excluded_reason -> rows added now with it."""
    part: Path | None = None


def adapter(name: str):
    if name not in ADAPTERS:
        raise SpecError("from", name, sorted(ADAPTERS), reason="unknown source of published figures")
    return import_module(ADAPTERS[name])


def read_jsonl(path: str | Path) -> list[dict]:
    """The file's records (one JSON object a line; blank lines skipped), or a one-line error."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("file", str(path), reason="no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise SpecError("file", str(path), reason=f"cannot read it ({why})") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecError("file", f"{path}:{lineno}",
                            reason=f"malformed JSON line (col {err.colno}: {err.msg})") from None
        if not isinstance(rec, dict):
            raise SpecError("file", f"{path}:{lineno}", reason="each line must be a JSON object")
        records.append(rec)
    if not records:
        raise SpecError("file", str(path), reason="holds no records")
    return records


def excluded_hash(measurement_id: str) -> str:
    """`spec_hash` of a row with no spec: unique per record, never equal to a spec's hash."""
    return hashlib.sha256(f"excluded:{measurement_id}".encode()).hexdigest()


def finish_row(row: dict, name: str, version: str, collected_at: str) -> dict:
    """The adapter's columns plus the ones every published row shares."""
    out = {**COMMON, **row, "schema_version": SCHEMA_VERSION, "source": SOURCE,
           "harness_version": f"{name}/{version}", "sweep_name": name, "collected_at": collected_at}
    if out["outcome"] == "excluded" and not out.get("spec_hash"):
        out["spec_hash"] = excluded_hash(out["measurement_id"])
    return out


def present_ids(out: str | Path) -> set[str]:
    """measurement_id of every published row already in the dataset at `out`."""
    if not Path(out).exists():
        return set()
    df = store.load_dataset(out)
    return set(df.loc[df["source"] == SOURCE, "measurement_id"].dropna())


def import_file(name: str, path: str | Path, out: str | Path = DEFAULT_OUT) -> ImportReport:
    """Import the records of `path` (a `name` source) into the dataset at `out`."""
    mod = adapter(name)
    records = read_jsonl(path)
    report = ImportReport(source=name, path=str(path), out=Path(out), records=len(records))
    seen = present_ids(out)
    stamp = store.utc_now()
    rows = []
    for i, rec in enumerate(records, 1):
        try:
            row = finish_row(mod.row(rec), mod.NAME, mod.VERSION, stamp)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, SpecError):
                raise
            raise SpecError("file", f"{path}: record {i}",
                            reason=f"not a {name} record ({type(err).__name__}: {err})") from None
        if row["measurement_id"] in seen:
            report.already_present += 1
            continue
        seen.add(row["measurement_id"])
        rows.append(row)
        report.outcomes[row["outcome"]] += 1
        if row["outcome"] == "excluded":
            report.excluded[row["excluded_reason"]] += 1
    if rows:
        report.part = store.append_rows(out, rows)
    report.added = len(rows)
    return report
