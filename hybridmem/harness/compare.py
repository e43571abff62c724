"""Measured vs. predicted: each dataset row rebuilt as a spec and run through a tier.

`python -m hybridmem.harness.compare DATASET [--method analytic] [--csv FILE]` prints the spread
of (measured device peak - predicted device peak) over `ok` rows, and how the tier classified
the OOM rows. The device script runs it right after a collection.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pandas as pd

from hybridmem.errors import SpecError
from hybridmem.gpus import GiB
from hybridmem.harness.schema import spec_from_row


def compare(df: pd.DataFrame, method: str = "analytic") -> pd.DataFrame:
    """One line per ok/oom row: measured and predicted peaks (bytes), and their difference."""
    from hybridmem.predict import predict

    out = []
    for _, row in df[df["outcome"].isin(["ok", "oom"])].iterrows():
        try:
            pred = predict(spec_from_row(row), method=method)
        except SpecError as err:
            out.append({"spec_hash": row["spec_hash"], "error": str(err)})
            continue
        out.append({
            "spec_hash": row["spec_hash"], "model_name": row["model_name"],
            "micro_batch": row["micro_batch"], "seq_len": row["seq_len"],
            "precision": row["precision"], "train": row["train"], "grad_ckpt": row["grad_ckpt"],
            "outcome": row["outcome"], "gpu_memory_bytes": row["gpu_memory_bytes"],
            "measured_allocated": row["peak_allocated_bytes"],
            "measured_device": row["peak_device_bytes"],
            "predicted_allocated": pred.peak.allocated_bytes,
            "predicted_device": pred.peak.device_bytes, "error": ""})
    cmp = pd.DataFrame(out)
    if "measured_device" in cmp:
        cmp["diff_device"] = cmp["measured_device"] - cmp["predicted_device"]
        cmp["diff_allocated"] = cmp["measured_allocated"] - cmp["predicted_allocated"]
    return cmp


def spread(cmp: pd.DataFrame) -> dict:
    """Summary of measured - predicted over ok rows, in GiB; OOM rows the tier said would fit."""
    if "diff_device" not in cmp:
        return {"ok_rows": 0}
    ok = cmp[(cmp["outcome"] == "ok") & (cmp["measured_device"].fillna(0) > 0)]
    d = ok["diff_device"].astype(float) / GiB
    rel = (ok["diff_device"].astype(float).abs() / ok["measured_device"].astype(float))
    oom = cmp[cmp["outcome"] == "oom"]
    summary = {"ok_rows": int(len(ok)), "oom_rows": int(len(oom)),
               "oom_predicted_to_fit": int((oom["predicted_device"] <= oom["gpu_memory_bytes"]).sum()),
               "tier_errors": int((cmp["error"] != "").sum())}
    if len(ok):
        summary.update({
            "diff_device_gib": {k: round(float(v), 3) for k, v in {
                "min": d.min(), "p10": np.percentile(d, 10), "median": d.median(),
                "p90": np.percentile(d, 90), "max": d.max()}.items()},
            "mape_device_pct": round(float(rel.mean() * 100), 2),
            "diff_allocated_gib_median": round(float(ok["diff_allocated"].astype(float).median()
                                                     / GiB), 3)})
    return summary


def main(argv: list[str] | None = None) -> int:
    from hybridmem.harness.store import load_dataset

    ap = argparse.ArgumentParser(prog="python -m hybridmem.harness.compare")
    ap.add_argument("dataset")
    ap.add_argument("--method", default="analytic")
    ap.add_argument("--source", default="cuda", help="only rows of this source")
    ap.add_argument("--csv", help="write the per-row comparison here")
    args = ap.parse_args(argv)
    try:
        df = load_dataset(args.dataset)
        cmp = compare(df[df["source"] == args.source], args.method)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.csv:
        cmp.to_csv(args.csv, index=False)
    print(json.dumps({"method": args.method, **spread(cmp)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
