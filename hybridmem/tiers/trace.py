"""The trace tier behind the tier protocol: its config-JSON rule (`trace/scope.py`) and the
traced training step (`trace.estimate`), imported when it runs (it imports torch)."""

from __future__ import annotations

from hybridmem.tiers.protocol import Tier


class _Trace:
    name = "trace"
    per_rank = False  # tp / sp / FSDP2 x tp ranks: `parallel.estimate.per_rank_aware`

    @staticmethod
    def refusal(spec):
        from hybridmem.trace.scope import refusal

        return refusal(spec)

    @staticmethod
    def single_gpu():
        from hybridmem.trace import estimate

        return estimate

    @staticmethod
    def gpu_options(gpu):
        """Its cuBLAS workspace and capacity, as the analytic tier's (so they stay comparable)."""
        return {} if gpu is None else {"gpu": gpu}


TIER: Tier = _Trace()
