"""Shared helpers of the learned-tier tests: a toy base estimate and made-up dataset rows.

The rows are NOT measurements and not from the trace tier: their targets are the toy base times
a known, learnable factor, so a test can check that the residual learns it. They are labelled
`source="analytic"` (never "cuda"), the contract's label for non-measured rows.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from hybridmem.categories import empty_breakdown
from hybridmem.learned.dataset import shape_group
from hybridmem.models.loader import load_config_dict
from hybridmem.prediction import Peak, Prediction
from hybridmem.job.spec import TrainingSpec

MiB = 2**20


def toy_base(spec: TrainingSpec) -> Prediction:
    """A crude but deterministic stand-in for the analytic tier (for pipeline tests only).

    params ~ 12 L h^2 + 2 V h (the usual decoder count); 16 B/param (AdamW mixed precision);
    activations ~ 34 h bytes per token per layer (Korthikanti et al. 2022, no recompute);
    300 MiB context, 64 MiB workspace, 5 % fragmentation.
    """
    _, cfg = load_config_dict(spec.model)
    tc = cfg.get("text_config") or cfg
    h, L, V = tc["hidden_size"], tc["num_hidden_layers"], tc["vocab_size"]
    params = 12 * L * h * h + 2 * V * h
    bd = empty_breakdown()
    bd["param"] = 4 * params
    bd["grad"] = 4 * params
    bd["optimizer"] = 8 * params
    bd["activation"] = 34 * h * L * spec.micro_batch * spec.seq_len // (2 if spec.grad_ckpt else 1)
    bd["temporary"] = 4 * V * spec.micro_batch * spec.seq_len
    bd["workspace"] = 64 * MiB
    allocated = sum(bd.values())
    bd["fragmentation"] = allocated // 20
    bd["context"] = 300 * MiB
    reserved = allocated + bd["fragmentation"]
    peak = Peak(allocated_bytes=allocated, reserved_bytes=reserved,
                device_bytes=reserved + bd["context"], phase="backward", iteration=0)
    return Prediction(model=spec.model, method="analytic", params_total=params,
                      params_trainable=params, peak=peak, breakdown=bd, modules=())


def true_factor(spec: TrainingSpec) -> float:
    """The made-up 'measured / base' ratio the residual must learn (depends on the spec only)."""
    return 1.0 + (0.25 if spec.precision == "fp32" else 0.0) + (0.10 if spec.grad_ckpt else 0.0)


def shape_config(hidden: int, layers: int) -> dict:
    """A tiny LLaVA config (the tiny-llava preset) with a resized language model."""
    _, cfg = load_config_dict("tiny-llava")
    cfg = json.loads(json.dumps(cfg))
    cfg.pop("_source", None)
    cfg["text_config"].update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)
    return cfg


SHAPES: tuple[tuple[int, int], ...] = ((64, 2), (96, 2), (128, 3), (64, 4), (160, 2), (128, 5))


def make_rows(shapes=SHAPES, source: str = "analytic", torch_version: str = "2.13.0",
              seed: int = 0) -> pd.DataFrame:
    """Rows in the dataset contract's columns: 8 specs per shape, targets = toy base x factor."""
    from hybridmem.models.loader import materialize_config

    rng = np.random.default_rng(seed)
    rows = []
    for hidden, layers in shapes:
        cfg = shape_config(hidden, layers)
        text = json.dumps(cfg, sort_keys=True)
        for precision in ("bf16-mixed", "fp32"):
            for ckpt in (False, True):
                for batch, seq in ((1, 128), (4, 256)):
                    spec = TrainingSpec(model=materialize_config(text), micro_batch=batch,
                                        seq_len=seq, precision=precision, grad_ckpt=ckpt)
                    base = toy_base(spec)
                    f = true_factor(spec) * (1 + rng.normal(0, 0.005))
                    label = {**spec.to_dict(), "model": f"shape-{hidden}x{layers}"}
                    rows.append({
                        "schema_version": 1, "harness_version": "test",
                        "spec_hash": f"{shape_group(text)}-{precision}-{ckpt}-{batch}-{seq}",
                        "collected_at": "2026-11-29T00:00:00+00:00",
                        "source": source, "outcome": "ok", "error": "",
                        "spec_json": json.dumps(label), "model_config": text,
                        "model_name": label["model"], "micro_batch": batch, "seq_len": seq,
                        "images_per_sample": 1, "image_size": 30, "precision": precision,
                        "optimizer": "adamw", "train": "full", "attn": "sdpa", "grad_ckpt": ckpt,
                        "lora_r": 0, "world_size": 1,
                        "peak_allocated_bytes": base.peak.allocated_bytes,
                        "peak_reserved_bytes": int(base.peak.reserved_bytes * f),
                        "peak_device_bytes": int(base.peak.device_bytes * f),
                        "gpu_name": "cpu-trace", "gpu_memory_bytes": 80 * 2**30,
                        "cuda_version": "", "torch_version": torch_version,
                        "transformers_version": "5.24.0", "alloc_conf": "",
                    })
    df = pd.DataFrame(rows)
    for col in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes"):
        df[col] = df[col].astype("Int64")
    return df


def test_toy_base_sums_and_rows_follow_the_contract():
    from hybridmem.learned.dataset import validate

    df = make_rows(shapes=SHAPES[:2])
    assert validate(df) is df
    assert len(df) == 16 and set(df["source"]) == {"analytic"}
    assert df["model_config"].map(shape_group).nunique() == 2


def trusted_everywhere(targets) -> dict:
    """A `trust` record (registry metadata) under which every target's residual applies to every
    job group, for hand-built registry entries that test something else."""
    from hybridmem.adapters import GROUPS

    return {t: {g: {"apply": True, "rule": "beats-base", "evidence": {}} for g in GROUPS}
            for t in targets}
