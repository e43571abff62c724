"""Per-rank memory under data parallelism (DDP, ZeRO-1/2/3, FSDP2), and the training configs
users already have (DeepSpeed JSON, HF TrainingArguments, LLaVA recipes) as input.

The package imports nothing eagerly (importing torch-heavy estimators for a name lookup would be
slow); the public names are resolved on first use.
"""

from importlib import import_module

_EXPORTS = {
    "estimate_per_rank": "estimate", "smallest_fitting_setup": "fit",
    "from_deepspeed_json": "inputs", "from_training_args": "inputs", "merge_inputs": "inputs",
    "spec_from_inputs": "inputs", "RECIPES": "recipes", "ParallelSpec": "hybridmem.job.parallel",
    "STRATEGIES": "hybridmem.job.parallel", "check_parallel": "validate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    module = _EXPORTS[name]
    return getattr(import_module(module if "." in module else f"hybridmem.parallel.{module}"), name)
