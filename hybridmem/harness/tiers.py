"""The `trace` backend: the same sweep through the trace tier instead of a GPU.

Rows say which tier made them (`source` = "trace"); they are predictions, never measurements.
This is how CI runs the whole harness without a GPU.
"""

from __future__ import annotations

import time

from hybridmem.errors import SpecError

METHOD = "trace"
"""The tier the `trace` backend runs (`hybridmem.predict.METHODS`); also the rows' `source`."""


def estimate(spec) -> dict:
    """A result dict (same keys as a measurement) from the tier's prediction of `spec`."""
    from hybridmem.predict import predict

    start = time.perf_counter()
    try:
        pred = predict(spec, method=METHOD)
    except SpecError as err:  # the tier cannot handle this config: an error row, sweep goes on
        return {"outcome": "error", "error": str(err)[:500]}
    except Exception as err:  # a tier bug: recorded (and listed in red), the sweep goes on
        return {"outcome": "error", "error": f"{type(err).__name__}: {err}"[:500]}
    seconds = time.perf_counter() - start
    peak = pred.peak
    return {
        "outcome": "ok", "error": "",
        "peak_allocated_bytes": peak.allocated_bytes,
        "peak_reserved_bytes": peak.reserved_bytes,
        "peak_active_bytes": None,  # the tiers do not model the allocator's `active` counter
        "peak_device_bytes": peak.device_bytes,
        "device_baseline_bytes": 0,
        "context_bytes": pred.breakdown.get("context"),
        "device_source": METHOD,
        "peak_phase": peak.phase, "peak_iteration": peak.iteration,
        "num_alloc_retries": 0, "num_ooms": 0,
        "params_total": pred.params_total, "params_trainable": pred.params_trainable,
        "iteration_seconds": [seconds],
    }
