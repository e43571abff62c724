"""The learned residual tier: LightGBM corrections of the analytic estimate, from measured rows.

Modules, one job each (data flows one way: dataset -> features -> model -> registry):
- `dataset`: load and validate rows of the collect dataset (the agreed column contract);
- `features`: spec, base-estimate and environment features; residual targets;
- `model`: the scikit-learn-style LightGBM residual (point + P95 quantile);
- `conformal`: per-job-group conformal margins of the upper bound;
- `metrics`, `evaluate`: grouped cross-validation by model shape, the forward torch-version
  hold-out, tier-vs-tier tables, plot;
- `trust`: per target and job group, whether the held-out evidence trusts the residual;
- `registry`: `models/NAME/` folders with metadata, atomic writes, environment matching;
- `train`: the `hybridmem train` pipeline (MLflow-tracked);
- `holdout`: `hybridmem evaluate --holdout torch|source`, every tier on held-out versions or
  sources (one MLflow run per split);
- `predictor`: `estimate(spec)` for `predict --method hybrid`.

Nothing here imports lightgbm, scikit-learn or mlflow at module import time, so
`import hybridmem` stays light.
"""
