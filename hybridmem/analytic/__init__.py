"""Analytic tier: closed-form memory per layer and per factor, peak over a phase timeline."""

from hybridmem.analytic.estimate import estimate

__all__ = ["estimate"]
