"""The learned ("hybrid") tier behind the tier protocol (`hybridmem/tiers/protocol.py`),
registered into `hybridmem.tiers.TIERS` when imported (by `hybridmem/__init__.py`).

Why it registers itself: this package sits above the chooser (its training tools read the
harness's rows and call `predict`), so the layers below cannot import it; registering keeps
every edge in the import graph the layers check, with no module named in a string. Importing
this module imports nothing heavy: the predictor (numpy, pandas, LightGBM) loads when it runs.
"""

from __future__ import annotations

from hybridmem.tiers import refusal, register


class _Hybrid:
    name = "hybrid"
    per_rank = True
    """Its base is already the per-rank analytic estimate (`features.analytic_base`), and its
    residual was trained on that base with the strategy among the features: sharding its answer
    again would serve a different path than `hybridmem evaluate` scores."""

    @staticmethod
    def refusal(spec):
        """It answers with the trace tier where the analytic one refuses (`predictor.estimate`),
        so it refuses only what both refuse."""
        refused = refusal("analytic", spec)
        return refused if refused is not None and refusal("trace", spec) is not None else None

    @staticmethod
    def single_gpu():
        from hybridmem.learned.predictor import estimate

        return estimate

    @staticmethod
    def gpu_options(gpu):
        """The residual is chosen per GPU type (its analytic base stays GPU-free, as its
        training rows were); a job only the trace tier prices gets the GPU there."""
        return {} if gpu is None else {"gpu_name": gpu.name, "gpu": gpu}

    @staticmethod
    def applies(spec) -> bool:
        """Whether a GPU-calibrated model for this environment answers `spec` (the chooser's
        policy, `predictor.default_method`); ImportError without the `learned` extra."""
        from hybridmem.learned.predictor import default_method

        return default_method(spec=spec) == "hybrid"

    @staticmethod
    def models_root():
        """Where it looks for models (shipped with hybridmem, or $HYBRIDMEM_MODELS)."""
        from hybridmem.learned.registry import models_root

        return models_root()


TIER = register(_Hybrid())
