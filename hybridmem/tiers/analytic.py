"""The analytic tier behind the tier protocol: its torch-free rule (`analytic/scope.py`) and
its closed-form estimate (`analytic.estimate`), imported when it runs."""

from __future__ import annotations

from hybridmem.tiers.protocol import Tier


class _Analytic:
    name = "analytic"
    per_rank = False  # the per-rank wrapper lends it its whole timeline (parallel.estimate)

    @staticmethod
    def refusal(spec):
        from hybridmem.analytic.scope import refusal

        return refusal(spec)

    @staticmethod
    def single_gpu():
        from hybridmem.analytic import estimate

        return estimate

    @staticmethod
    def gpu_options(gpu):
        """Its cuBLAS workspace and capacity: the GPU itself (the same as the trace tier's)."""
        return {} if gpu is None else {"gpu": gpu}


TIER: Tier = _Analytic()
