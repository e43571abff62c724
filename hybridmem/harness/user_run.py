"""A user's own training run as a dataset row (`source = "user"`), and merging users' folders.

The integrations (`hybridmem.integrations`) measure a real run after its first steps: the
allocator's peaks, NVML's device figure, the lengths the data really had. That is ground truth
as good as `hybridmem collect`'s, with two differences the row says: the data is the user's
(lengths vary: `seq_len` is the longest seen, `seq_len_kind` "upper-bound"), and the peaks
are since the process started, not per phase. The row has `collect`'s schema
(`hybridmem.harness.schema`), written by the same atomic store, so `hybridmem train` reads it.

Identity: `measurement_id` names the run (host, time, job), so one run imported twice is one
row, and two users' runs of the same job are two measurements (the reader de-duplicates on
`spec_hash` + environment + `measurement_id`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.harness import store
from hybridmem.harness.schema import HARNESS_VERSION, SCHEMA_VERSION, spec_hash

SOURCE = "user"
"""The rows of users' own runs (docs/learned.md, "Sources"); `cuda` stays `collect`'s."""
DEFAULT_OUT = Path("datasets") / "user"
MEASURED_KEYS: tuple[str, ...] = ("peak_allocated_bytes", "peak_reserved_bytes",
                                  "peak_device_bytes", "num_alloc_retries", "num_ooms")
"""What a run reports (`measured` of `user_row`); None where it could not be read."""


def user_row(spec, model_config: dict, measured: dict, env: dict, *, steps: int,
             step_seconds: float | None = None, label: str = "") -> dict:
    """The dataset row of a measured run: `spec` as it ran (its model a config path,
    `seq_len` the longest sequence seen), the model's full config, what was measured after
    `steps` steps and the environment (`gpu_name`, `gpu_memory_bytes`, `driver_version`,
    `cuda_version`, `torch_version`, `transformers_version`, `alloc_conf`, `hostname`)."""
    from hybridmem.harness.collection import spec_columns
    from hybridmem.harness.sweep import SweepItem, image_tokens_of

    item = SweepItem(label=label or spec.model, config=model_config, spec=spec,
                     spec_hash=spec_hash(spec.to_dict(), model_config), block=SOURCE, axes=(),
                     image_tokens=image_tokens_of(spec), est_seconds=0.0)
    stamp = store.utc_now()
    run = f"{env.get('hostname', '')}|{stamp}|{item.spec_hash}"
    row = {"schema_version": SCHEMA_VERSION, "harness_version": HARNESS_VERSION,
           "collected_at": stamp, "source": SOURCE, "outcome": "ok", "error": "",
           "sweep_name": SOURCE, **spec_columns(item), "iterations": steps,
           "step_seconds": step_seconds, "wall_seconds": None, "phase_peaks_json": "[]",
           "rank_peaks_json": "", "history_path": "", "seq_len_kind": "upper-bound",
           "device_source": measured.get("device_source") or "none",
           "measurement_id": "user-" + hashlib.sha256(run.encode()).hexdigest()[:16],
           **{k: measured.get(k) for k in MEASURED_KEYS}}
    row.update({k: env.get(k) for k in ("gpu_name", "gpu_memory_bytes", "driver_version",
                                       "cuda_version", "torch_version", "transformers_version",
                                       "alloc_conf", "hostname")})
    return row


@dataclass
class MergeReport:
    folders: int
    rows: int
    added: int
    already_present: int
    part: Path | None


def merge_folders(folders: list[str | Path], out: str | Path = DEFAULT_OUT) -> MergeReport:
    """Users' dataset folders (each written by an integration) merged into `out`: their
    `user` rows not already there (by `measurement_id`), as one new part file; rows of any
    other source are refused (a user folder holds only its own runs)."""
    seen: set[str] = set()
    if Path(out).exists():
        have = store.load_dataset(out)
        seen = set(have.loc[have["source"] == SOURCE, "measurement_id"])
    rows, total, dup = [], 0, 0
    for folder in folders:
        df = store.load_dataset(folder)
        other = sorted(set(df["source"]) - {SOURCE})
        if other:
            raise SpecError("folder", str(folder), [SOURCE],
                            reason=f"holds rows of source {other[0]!r}, not a user run's")
        for record in json.loads(df.to_json(orient="records")):
            total += 1
            if record["measurement_id"] in seen:
                dup += 1
                continue
            seen.add(record["measurement_id"])
            rows.append(record)
    part = store.append_rows(out, rows) if rows else None
    return MergeReport(len(folders), total, len(rows), dup, part)
