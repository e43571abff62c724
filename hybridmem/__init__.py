"""hybridmem: predict the peak GPU memory of a training job before it runs."""

from hybridmem.errors import SpecError
from hybridmem.prediction import Prediction
from hybridmem.predict import predict
from hybridmem.learned import tier as _learned_tier  # noqa: F401  (registers the hybrid tier)
from hybridmem.job.spec import LoraSpec, ParallelSpec, TrainingSpec

__version__ = "0.1.0"
__all__ = ["LoraSpec", "ParallelSpec", "Prediction", "SpecError", "TrainingSpec", "predict"]
