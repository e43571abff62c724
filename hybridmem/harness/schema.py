"""The dataset's columns, their types and versions: the contract with the learned tier.

`datasets/README.md` documents every column; `COLUMNS` is the machine-readable copy of it, and
the store casts each row to these types so every part file has the same parquet schema.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from hybridmem.job.recorded import RECORDED

if TYPE_CHECKING:
    from hybridmem.job.spec import TrainingSpec

SCHEMA_VERSION = 1
"""Bump when a column changes meaning or type (readers refuse a newer schema)."""
HARNESS_VERSION = "0.1.0"
"""Bump when the measurement protocol changes (what is run, how peaks are read)."""

SOURCES: tuple[str, ...] = ("cuda", "published", "user", "trace", "analytic")
"""`cuda`: measured by `hybridmem collect`; `published`: measured on a real GPU by someone else
and imported (`hybridmem import`, hybridmem/published/); `user`: a user's own training run,
measured by an integration's callback (`hybridmem.harness.user_run`, merged by `hybridmem
import --from user`); `trace`, `analytic`: tier predictions."""
REAL_SOURCES: tuple[str, ...] = ("cuda", "published", "user")
"""Sources whose peaks were measured on a real GPU (ground truth); the others are predictions."""
OUTCOMES: tuple[str, ...] = ("ok", "oom", "error", "excluded")
"""`excluded`: an imported measurement whose job a `TrainingSpec` cannot represent yet
(`excluded_reason` says why); kept for the record, never fitted or evaluated."""
ENV_KEY: tuple[str, ...] = ("gpu_name", "torch_version", "source")
"""Columns that, with `spec_hash`, identify a measurement: `--resume` skips a spec measured
under the same key, and the reader keeps the newest row per key (and `measurement_id`)."""
IDENTITY: tuple[str, ...] = ("measurement_id",)
"""Extra key of the reader's dedup: an imported row's own id (published re-runs of one spec on
one torch are distinct measurements); empty in collect's rows, so their key is unchanged."""

# Columns added after version 1 without a version bump (a reader of version 1 ignores them);
# parts written before them read back with these values.
ADDED_COLUMNS: dict[str, object] = {
    "strategy": "none", "rank_peaks_json": "",
    # the loop and the techniques (hybridmem/job/recorded.py): at the spec's defaults
    **{name: default for name, (_, default) in RECORDED.items()},
    # imported (published) measurements; empty / null in collect's rows
    "measurement_id": "", "excluded_reason": "", "group": "", "experiment": "",
    "seq_len_kind": "exact", "published_value_bytes": None, "published_metric": "",
    "steady_allocated_bytes": None, "empty_cache_every_n_steps": None, "measured_at": "",
    "peft_version": "", "source_repo": "", "source_path": "", "source_commit": "",
    "source_url": "", "published_json": "",
}

# column -> pandas dtype ("Int64"/"boolean" are nullable: oom/error rows have no peaks)
COLUMNS: dict[str, str] = {
    # identity and provenance
    "schema_version": "int64",
    "harness_version": "string",
    "spec_hash": "string",
    "collected_at": "string",
    "source": "string",
    "outcome": "string",
    "error": "string",
    "sweep_name": "string",
    "spec_json": "string",
    "model_config": "string",
    # flattened spec
    "model_name": "string",
    "model_type": "string",
    "micro_batch": "int64",
    "seq_len": "int64",
    "images_per_sample": "int64",
    "image_size": "int64",
    "image_width": "int64",  # added later; old parts: = image_size (harness/image_columns.py)
    "image_tokens": "int64",
    "precision": "string",
    "optimizer": "string",
    "train": "string",
    "attn": "string",
    "grad_ckpt": "bool",
    "lora_r": "int64",
    "world_size": "int64",
    "strategy": "string",
    **{name: dtype for name, (dtype, _) in RECORDED.items()},
    "params_total": "Int64",
    "params_trainable": "Int64",
    "param_bytes": "Int64",
    "optimizer_state_bytes": "Int64",
    # targets (null for oom / error rows)
    "peak_allocated_bytes": "Int64",
    "peak_reserved_bytes": "Int64",
    "peak_active_bytes": "Int64",
    "peak_inactive_split_bytes": "Int64",
    "peak_device_bytes": "Int64",
    "device_baseline_bytes": "Int64",
    "context_bytes": "Int64",
    "device_source": "string",
    "peak_phase": "string",
    "peak_iteration": "Int64",
    "num_alloc_retries": "Int64",
    "num_ooms": "Int64",
    "oom_phase": "string",
    "iterations": "int64",
    "step_seconds": "float64",
    "wall_seconds": "float64",
    "phase_peaks_json": "string",
    "rank_peaks_json": "string",
    # environment
    "gpu_name": "string",
    "gpu_memory_bytes": "int64",
    "driver_version": "string",
    "cuda_version": "string",
    "torch_version": "string",
    "transformers_version": "string",
    "alloc_conf": "string",
    "hostname": "string",
    "history_path": "string",
    # imported measurements (source "published"; see datasets/published/README.md)
    "measurement_id": "string",
    "excluded_reason": "string",
    "group": "string",
    "experiment": "string",
    "seq_len_kind": "string",
    "published_value_bytes": "Int64",
    "published_metric": "string",
    "steady_allocated_bytes": "float64",
    "empty_cache_every_n_steps": "Int64",
    "measured_at": "string",
    "peft_version": "string",
    "source_repo": "string",
    "source_path": "string",
    "source_commit": "string",
    "source_url": "string",
    "published_json": "string",
}


def spec_hash(spec_dict: dict, model_config: dict) -> str:
    """sha256 of the canonical spec JSON with the model's full config in place of its label.

    The label (a display name) is left out so that renaming a shape does not re-measure it.
    """
    canonical = {**spec_dict, "model": model_config}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def spec_from_row(row) -> TrainingSpec:
    """The `TrainingSpec` a dataset row was measured with: `spec_json` with `model` pointing at
    its `model_config` materialised to a file (the contract in datasets/README.md)."""
    from hybridmem.models.loader import materialize_config
    from hybridmem.job.spec import TrainingSpec

    return TrainingSpec.from_dict({**json.loads(row["spec_json"]),
                                   "model": materialize_config(row["model_config"])})

