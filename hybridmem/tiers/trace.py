"""The trace tier behind the tier protocol: its config-JSON rule (`trace/scope.py`), the traced
training step (`trace.estimate`) and its traced tp / sp / FSDP2 x tp ranks
(`parallel/trace_ranks.py`, which refuses the other layouts), imported when it runs (it imports
torch)."""

from __future__ import annotations

from hybridmem.tiers.protocol import OneGpuTier, Tier


class _Trace(OneGpuTier):
    name = "trace"

    @staticmethod
    def refusal(spec):
        from hybridmem.trace.scope import refusal

        return refusal(spec)

    @staticmethod
    def single_gpu():
        from hybridmem.trace import estimate

        return estimate

    @staticmethod
    def timeline():
        return None  # the per-rank wrapper reads the points off the traced answer

    @staticmethod
    def model_parallel():
        from hybridmem.parallel.trace_ranks import estimate

        return estimate


TIER: Tier = _Trace()
