"""Features and residual targets of the learned tier.

One function, `feature_row`, turns (spec, model config, base estimate, environment) into a
flat dict, so training rows and a user's spec at predict time are featurised the same way.
Targets are residuals on the base estimate, `log(measured / base)`: a ratio generalises to
model sizes the trees never saw, where raw bytes could not (trees do not extrapolate).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hybridmem.categories import CATEGORIES
from hybridmem.learned.dataset import config_groups, shape_group
from hybridmem.learned.versions import major_minor  # noqa: F401 (also this module's name)
from hybridmem.adapters import peft_type
from hybridmem.errors import SpecError
from hybridmem.job.images import parse_image_size
from hybridmem.techniques.quantize import BITS
from hybridmem.job.schema import feature_values
from hybridmem.prediction import Prediction
from hybridmem.job.spec import TrainingSpec, ckpt_every

BaseFn = Callable[[TrainingSpec], Prediction]

CATEGORICAL: tuple[str, ...] = ("precision", "optimizer", "train", "attn", "strategy",
                                "base_phase", "gpu_name", "loop", "peft_type", "offload_activations")
"""Features encoded as categories (codes learned at fit time; unseen values become missing)."""

RANGE_FEATURES: tuple[str, ...] = ("micro_batch", "seq_len", "image_tokens", "params_total",
                                   "params_trainable", "hidden_size", "num_layers", "base_device_gib")
"""Main features whose training ranges go into the registry metadata (predict warns outside)."""

NEIGHBOUR_FEATURES: tuple[str, ...] = ("micro_batch", "seq_len", "image_tokens", "precision",
                                       "optimizer", "train", "lora_r", "peft_type", "grad_ckpt",
                                       "loop", "world_size", "strategy", "num_layers",
                                       "hidden_size")
"""What a user's spec is compared on with the training rows (`predictor.nearest`)."""


def analytic_base(spec: TrainingSpec) -> Prediction:
    """The default base estimate: what `predict --method analytic` serves for `spec`, i.e. the
    analytic tier priced per rank for a multi-GPU spec (`hybridmem.parallel.estimate`).

    The one base of the learned tier: `build_table` (training and `evaluate` rows) and
    `predictor.estimate` (a user's spec) both call it, so a residual is learned and applied on
    the same per-rank figure, and the strategy features say what the sharding left to correct.
    """
    from hybridmem.tiers import estimator

    return estimator("analytic")(spec)


def resolve_base(base_fn: BaseFn | None) -> BaseFn:
    """`base_fn`, or the analytic tier looked up at call time (tests can patch `analytic_base`)."""
    return base_fn or analytic_base


def _version_number(text: object) -> float:
    """'2.13.0+cu124' -> 2.13 as major + minor/100 (NaN when unknown), a sortable feature."""
    version = major_minor(text)
    if version is None:
        return float("nan")
    major, minor = version.split(".")
    return int(major) + int(minor) / 100


def _side(value: object) -> object:
    """A side in pixels / patches: InternVL's configs give [height, width] (the first)."""
    return value[0] if isinstance(value, (list, tuple)) and value else value


def config_features(config: Mapping) -> dict[str, float]:
    """Sizes of the language model and vision tower from a raw HF config dict."""
    text = config.get("text_config") or config
    vision = config.get("vision_config") or {}
    heads = text.get("num_attention_heads", 0)
    patch = _side(vision.get("patch_size", 0)) or 0
    img = _side(vision.get("image_size", 0)) or 0
    return {
        "hidden_size": text.get("hidden_size", 0),
        "num_layers": text.get("num_hidden_layers", 0),
        "intermediate_size": text.get("intermediate_size", 0),
        "num_heads": heads,
        "num_kv_heads": text.get("num_key_value_heads") or heads,
        "vocab_size": text.get("vocab_size") or config.get("vocab_size", 0),
        "vision_hidden": vision.get("hidden_size", 0),
        "vision_layers": vision.get("num_hidden_layers", 0),
        "vision_image_size": img,
        "vision_patch": patch,
    }


def spec_features(spec: TrainingSpec, config: Mapping) -> dict[str, object]:
    """What the user chose: sizes, batch, lengths, image tokens, dtypes, optimizer, ...; the
    precision and attention the model implies where the spec leaves them unset, as predicted."""
    from hybridmem.families.defaults import as_job

    spec = as_job(spec)  # a dataset row's or a test's plain spec; a Job as it is
    vision = config.get("vision_config") or {}
    multimodal = bool(vision)
    images = spec.images_per_sample if spec.images_per_sample is not None else int(multimodal)
    height, width = parse_image_size(spec.image_size or _side(vision.get("image_size", 0))
                                     or None) or (0, 0)
    # an HxW image as the side of the square of its area (a square's side unchanged)
    size = round(math.sqrt(height * width))
    patch = _side(vision.get("patch_size", 0)) or 0
    # CLIP/SigLIP: (size / patch)^2 patch tokens per image (LLaVA-1.5 drops CLS: 24x24 = 576);
    # an HxW image (H / patch)(W / patch); LLaVA-NeXT's anyres tiling adds more, which the
    # base estimate accounts for.
    per_image = (height // patch) * (width // patch) if patch else 0
    return {
        # every job field declared with `feature=True` (hybridmem/job/schema.py), as it is
        **feature_values(spec),
        # and what needs the model config or more than one field
        "tokens": spec.micro_batch * spec.seq_len,
        "images_per_sample": images,
        "image_size": size,
        "image_tokens": images * per_image,
        # share of layers checkpointed: 1 for `full`, 1/N for `every:N`, 0 without --grad-ckpt
        "ckpt_share": (1.0 / ckpt_every(spec.grad_ckpt_policy)) if spec.grad_ckpt else 0.0,
        "lora_r": spec.lora.r if spec.lora is not None else 0,
        "peft_type": peft_type(spec) or "none",
        # bits of a quantised base weight (0 = not quantised; `techniques.quantize.BITS`)
        "quant_bits": BITS[spec.quantize],
    }


def base_features(base: Prediction) -> dict[str, object]:
    """Every factor of the base breakdown (bytes and share of the device peak) and its peaks."""
    device = max(base.peak.device_bytes, 1)
    out: dict[str, object] = {
        "params_total": base.params_total,
        "params_trainable": base.params_trainable,
        "base_allocated_gib": base.peak.allocated_bytes / 2**30,
        "base_reserved_gib": base.peak.reserved_bytes / 2**30,
        "base_device_gib": base.peak.device_bytes / 2**30,
        "base_log_device": math.log(device),
        "base_phase": base.peak.phase,
        "base_iteration": base.peak.iteration,
    }
    for cat in CATEGORIES:
        out[f"base_{cat}_gib"] = base.breakdown.get(cat, 0) / 2**30
        out[f"share_{cat}"] = base.breakdown.get(cat, 0) / device
    return out


def env_features(gpu_name: str, gpu_memory_bytes: float, torch_version: str,
                 cuda_version: str, alloc_conf: str = "") -> dict[str, object]:
    """The environment: GPU, its memory, torch and CUDA versions, allocator settings."""
    return {
        "gpu_name": gpu_name,
        "gpu_memory_gib": gpu_memory_bytes / 2**30 if gpu_memory_bytes else float("nan"),
        "torch": _version_number(torch_version),
        "cuda": _version_number(cuda_version),
        "expandable_segments": int("expandable_segments:true" in str(alloc_conf).replace(" ", "").lower()),
    }


TRACE_FEATURES: tuple[str, ...] = ("trace_allocated_gib", "trace_reserved_gib",
                                   "trace_device_gib", "trace_over_base")
"""Optional features from the trace tier's peaks (`train --trace-features`): from the dataset's
trace rows of the same spec when training, from running the trace tier when predicting."""


def trace_features(allocated, reserved, device, base_device) -> dict:
    """The trace tier's three peaks (GiB) and its device peak over the base's (numbers, or
    arrays of one per row)."""
    return {"trace_allocated_gib": allocated / 2**30, "trace_reserved_gib": reserved / 2**30,
            "trace_device_gib": device / 2**30, "trace_over_base": device / base_device}


def trace_columns(table: "FeatureTable", all_rows: pd.DataFrame) -> pd.DataFrame:
    """`TRACE_FEATURES` for each row of `table` from trace rows of the same spec (NaN if none)."""
    trace = all_rows[(all_rows["source"] == "trace") & (all_rows["outcome"] == "ok")]
    peaks = trace.groupby("spec_hash")[["peak_allocated_bytes", "peak_reserved_bytes",
                                        "peak_device_bytes"]].median()
    joined = peaks.reindex(table.rows["spec_hash"]).to_numpy(float)
    return pd.DataFrame(trace_features(joined[:, 0], joined[:, 1], joined[:, 2], table.base_device))


def feature_row(spec: TrainingSpec, config: Mapping, base: Prediction,
                env: Mapping[str, object]) -> dict[str, object]:
    """All features of one (spec, environment); `env` holds `env_features` arguments."""
    return {**spec_features(spec, config), **config_features(config), **base_features(base),
            **env_features(**env)}


def _text(value: object) -> str:
    """A text cell as str; missing values (None, NaN, pd.NA) as ''."""
    return "" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


def row_spec(row: Mapping) -> tuple[TrainingSpec, dict]:
    """(TrainingSpec, raw config dict) rebuilt from a dataset row (see the dataset contract)."""
    from hybridmem.harness.schema import spec_from_row

    return spec_from_row(row), json.loads(row["model_config"])


@dataclass
class FeatureTable:
    """Features, bases and targets of the usable rows (aligned by position)."""

    X: pd.DataFrame
    rows: pd.DataFrame
    """The dataset rows kept (same order as X)."""
    base_device: np.ndarray
    base_reserved: np.ndarray
    dropped: dict[str, str] = field(default_factory=dict)
    """spec_hash -> why the base estimate failed for it (those rows are left out)."""

    @property
    def group_kind(self) -> str:
        """The unit held out in evaluation: "model shape" (`dataset.shape_group`), or
        "configuration" when every row has the same model (the published benchmarks;
        `dataset.config_groups`: experiment and spec joined)."""
        shapes = self.rows["model_config"].map(shape_group).nunique()
        return "model shape" if shapes >= 2 else "configuration"

    @property
    def groups(self) -> np.ndarray:
        """Each row's `group_kind` group."""
        if self.group_kind == "model shape":
            return self.rows["model_config"].map(shape_group).to_numpy()
        return np.array(config_groups(self.rows))

    def target(self, name: str) -> np.ndarray:
        """log(measured / base) for `name` in ("device", "reserved")."""
        if name == "device":
            return np.log(self.rows["peak_device_bytes"].to_numpy(float) / self.base_device)
        if name == "reserved":
            return np.log(self.rows["peak_reserved_bytes"].to_numpy(float) / self.base_reserved)
        raise SpecError("target", name, ("device", "reserved"))


def build_table(rows: pd.DataFrame, base_fn: BaseFn | None = None) -> FeatureTable:
    """Featurise dataset rows; the base estimate runs once per distinct spec."""
    base_fn = resolve_base(base_fn)
    cache: dict[str, tuple[TrainingSpec, dict, Prediction] | str] = {}
    records, keep = [], []
    for i, row in enumerate(rows.to_dict("records")):
        key = row["spec_hash"]
        if key not in cache:
            try:
                spec, config = row_spec(row)
                cache[key] = (spec, config, base_fn(spec))
            except SpecError as err:  # includes UnsupportedModelError
                cache[key] = str(err)
            except (ValueError, TypeError, KeyError) as err:  # malformed spec_json / model_config
                cache[key] = f"unreadable spec in the row ({type(err).__name__}: {err})"
        hit = cache[key]
        if isinstance(hit, str):
            continue
        spec, config, base = hit
        env = {"gpu_name": row["gpu_name"], "gpu_memory_bytes": row["gpu_memory_bytes"],
               "torch_version": _text(row["torch_version"]), "cuda_version": _text(row["cuda_version"]),
               "alloc_conf": _text(row.get("alloc_conf"))}
        records.append((feature_row(spec, config, base, env), base))
        keep.append(i)
    dropped = {k: v for k, v in cache.items() if isinstance(v, str)}
    if not records:
        reason = next(iter(dropped.values()), "no rows")
        raise SpecError("data", f"{len(rows)} rows", reason=f"no row has a base estimate ({reason})")
    X = pd.DataFrame([r for r, _ in records])
    bases = [b for _, b in records]
    return FeatureTable(
        X=X, rows=rows.iloc[keep].reset_index(drop=True),
        base_device=np.array([b.peak.device_bytes for b in bases], dtype=float),
        base_reserved=np.array([b.peak.reserved_bytes for b in bases], dtype=float),
        dropped=dropped)


class FeatureEncoder:
    """Feature dicts -> a float matrix with stable columns; categories become integer codes.

    scikit-learn conventions: `fit` learns `columns_` and `categories_` and returns self.
    """

    def fit(self, X: pd.DataFrame) -> "FeatureEncoder":
        self.columns_ = list(X.columns)
        self.categories_ = {c: sorted(str(v) for v in X[c].dropna().unique())
                            for c in X.columns if c in CATEGORICAL}
        return self

    def transform(self, X: pd.DataFrame) -> np.ndarray:
        out = np.full((len(X), len(self.columns_)), np.nan)
        for j, col in enumerate(self.columns_):
            if col not in X.columns:
                continue
            if col in self.categories_:
                codes = {v: k for k, v in enumerate(self.categories_[col])}
                out[:, j] = [codes.get(str(v), np.nan) for v in X[col]]
            else:
                out[:, j] = pd.to_numeric(X[col], errors="coerce").to_numpy(float)
        return out

    @property
    def categorical_indices_(self) -> list[int]:
        return [j for j, c in enumerate(self.columns_) if c in self.categories_]

    def to_dict(self) -> dict:
        return {"columns": self.columns_, "categories": self.categories_}

    @classmethod
    def from_dict(cls, data: Mapping) -> "FeatureEncoder":
        enc = cls()
        enc.columns_ = list(data["columns"])
        enc.categories_ = {k: list(v) for k, v in data["categories"].items()}
        return enc
