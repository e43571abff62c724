"""The analytic tier behind the tier protocol: its torch-free rule (`analytic/scope.py`), its
closed-form estimate (`analytic.estimate`), its whole timeline and its model-parallel ranks
(`parallel/`), imported when it runs."""

from __future__ import annotations

from hybridmem.tiers.protocol import OneGpuTier, Tier


class _Analytic(OneGpuTier):
    name = "analytic"

    @staticmethod
    def refusal(spec):
        from hybridmem.analytic.scope import refusal

        return refusal(spec)

    @staticmethod
    def single_gpu():
        from hybridmem.analytic import estimate

        return estimate

    @staticmethod
    def timeline():
        from hybridmem.parallel.estimate import analytic_points

        return analytic_points

    @staticmethod
    def model_parallel():
        from hybridmem.parallel.estimate import analytic_ranks

        return analytic_ranks


TIER: Tier = _Analytic()
