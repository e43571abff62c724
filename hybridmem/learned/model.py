"""The residual model: LightGBM behind a scikit-learn-style estimator.

`ResidualRegressor` learns y = log(measured / base) from feature dicts. It fits two boosters:
an L2 one for the expected residual and a quantile one (alpha = 0.95 by default) for a safe
upper bound, so "will it fit?" gets both the expected peak and a P95 band. Quantile boosters
are poorly calibrated on a few hundred rows, so when `fit` gets groups (model shapes) it also
learns conformal margins: per job group, the alpha-quantile of out-of-group residuals of the
point model (CV+ of Barber et al. 2021, "Predictive inference with the jackknife+", made
per-group in `conformal`); the bound is the larger of the two.
Conventions (scikit-learn): `__init__` only stores hyperparameters; `fit` validates, learns the
attributes ending in `_`, and returns self.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin

from hybridmem.errors import SpecError
from hybridmem.learned.conformal import POOLED, feature_groups, group_margins, margin_for
from hybridmem.learned.features import FeatureEncoder


def auto_min_leaf(n_rows: int) -> int:
    """Rows per leaf for 20..2000 rows: n/10 clipped to [2, 20].

    LightGBM's default (20, `min_data_in_leaf` in its Parameters docs) leaves a 20-row dataset
    with a single leaf, i.e. no model; 2 is the smallest leaf that still averages two rows.
    """
    return int(min(20, max(2, n_rows // 10)))


class ResidualRegressor(RegressorMixin, BaseEstimator):
    """LightGBM point + quantile regressor on the log-ratio residual."""

    def __init__(self, *, n_estimators: int = 300, learning_rate: float = 0.05,
                 num_leaves: int = 15, min_child_samples: int | None = None,
                 reg_lambda: float = 1.0, alpha: float = 0.95, n_jobs: int = 1,
                 random_state: int = 0) -> None:
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.num_leaves = num_leaves
        self.min_child_samples = min_child_samples
        self.reg_lambda = reg_lambda
        self.alpha = alpha
        self.n_jobs = n_jobs
        self.random_state = random_state

    def _params(self, n_rows: int) -> dict:
        leaf = self.min_child_samples or auto_min_leaf(n_rows)
        return {
            "learning_rate": self.learning_rate, "num_leaves": self.num_leaves,
            "min_data_in_leaf": leaf, "min_data_per_group": leaf, "cat_smooth": 1.0,
            # small data: LightGBM's default min_data_in_bin=3 / max_bin=255 merge or waste bins
            "min_data_in_bin": 1, "max_bin": 63, "lambda_l2": self.reg_lambda,
            "num_threads": self.n_jobs, "seed": self.random_state, "deterministic": True,
            "force_row_wise": True, "verbose": -1,
        }

    def fit(self, X: pd.DataFrame, y, groups=None) -> "ResidualRegressor":
        import lightgbm as lgb

        y = np.asarray(y, dtype=float)
        if not isinstance(X, pd.DataFrame):
            raise SpecError("X", type(X).__name__, reason="expected a DataFrame of features")
        if len(X) != len(y) or len(y) == 0:
            raise SpecError("y", len(y), reason=f"needs one finite target per row ({len(X)} rows)")
        if not np.all(np.isfinite(y)):
            raise SpecError("y", "non-finite", reason="targets must be finite (measured and base > 0)")
        self.encoder_ = FeatureEncoder().fit(X)
        data = self.encoder_.transform(X)
        params = self._params(len(y))
        self.params_ = params

        def booster(extra: dict, rows=slice(None)):
            ds = lgb.Dataset(data[rows], label=y[rows], feature_name=self.encoder_.columns_,
                             categorical_feature=self.encoder_.categorical_indices_,
                             params={k: params[k] for k in ("min_data_in_bin", "max_bin", "verbose")},
                             free_raw_data=True)
            return lgb.train({**params, **extra}, ds, num_boost_round=self.n_estimators)

        self.point_ = booster({"objective": "regression"})
        self.upper_ = booster({"objective": "quantile", "alpha": self.alpha})
        self.margins_ = self._conformal_margins(data, y, groups, booster, feature_groups(X))
        self.margin_ = self.margins_[POOLED]
        self.n_features_in_ = data.shape[1]
        self.feature_names_in_ = np.array(self.encoder_.columns_, dtype=object)
        return self

    def _conformal_margins(self, data, y, groups, booster, strata) -> dict[str, float]:
        """Per job group (`conformal.group_margins`): the alpha-quantile of out-of-group
        residuals y - point(x); all 0 without >= 2 groups (no out-of-group residual exists)."""
        from sklearn.model_selection import GroupKFold

        if groups is None or len(set(groups)) < 2:
            return {POOLED: 0.0}
        oof = np.empty_like(y)
        splitter = GroupKFold(n_splits=min(5, len(set(groups))))
        for train, test in splitter.split(data, y, groups):
            oof[test] = booster({"objective": "regression"}, train).predict(data[test])
        return group_margins(y - oof, strata, self.alpha)

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        """Expected log(measured / base)."""
        return self.point_.predict(self.encoder_.transform(X))

    def predict_upper(self, X: pd.DataFrame) -> np.ndarray:
        """Upper {alpha} bound of log(measured / base), never below the expected value: the
        quantile booster or the point plus the row's job-group margin, whichever is higher."""
        data = self.encoder_.transform(X)
        point = self.point_.predict(data)
        margin = np.array([margin_for(self.margins_, g) for g in feature_groups(X)], dtype=float)
        return np.maximum(self.upper_.predict(data), point + margin)

    def feature_importances(self) -> dict[str, float]:
        """Gain importance of the point model per feature (for MLflow and the note)."""
        gains = self.point_.feature_importance(importance_type="gain")
        return dict(sorted(zip(self.encoder_.columns_, map(float, gains)), key=lambda kv: -kv[1]))

    # ---- persistence: LightGBM text models + a JSON sidecar (no pickle) ----

    def save(self, folder: Path, prefix: str) -> list[Path]:
        """Write `<prefix>.point.txt`, `<prefix>.upper.txt`, `<prefix>.json`; return the paths."""
        paths = [folder / f"{prefix}.point.txt", folder / f"{prefix}.upper.txt",
                 folder / f"{prefix}.json"]
        self.point_.save_model(str(paths[0]))
        self.upper_.save_model(str(paths[1]))
        paths[2].write_text(json.dumps({"hyperparameters": self.get_params(),
                                        "params": self.params_, "margin": self.margin_,
                                        "margins": self.margins_,
                                        "features": self.encoder_.to_dict()}, indent=1))
        return paths

    @classmethod
    def load(cls, folder: Path, prefix: str) -> "ResidualRegressor":
        import lightgbm as lgb

        try:
            side = json.loads((folder / f"{prefix}.json").read_text())
            est = cls(**side["hyperparameters"])
            est.params_ = side["params"]
            est.margin_ = float(side["margin"])
            est.margins_ = {str(k): float(v) for k, v in
                            (side.get("margins") or {POOLED: est.margin_}).items()}
            est.encoder_ = FeatureEncoder.from_dict(side["features"])
            est.point_ = lgb.Booster(model_file=str(folder / f"{prefix}.point.txt"))
            est.upper_ = lgb.Booster(model_file=str(folder / f"{prefix}.upper.txt"))
        except (OSError, KeyError, TypeError, ValueError, lgb.basic.LightGBMError) as err:
            raise SpecError("model", str(folder), reason=f"cannot load the {prefix!r} model ({err})") from None
        est.n_features_in_ = len(est.encoder_.columns_)
        est.feature_names_in_ = np.array(est.encoder_.columns_, dtype=object)
        return est
