"""Where users train: hybridmem inside a `transformers.Trainer` / TRL run, a Lightning run, or
an accelerate script. Each builds the job from the live objects with the same readers as
`hybridmem predict --config` (`live.py`), prices it before the first step and measures the
real run after the first steps (`check.py`).

    from hybridmem.integrations import HybridmemCallback         # Trainer, SFTTrainer, DPOTrainer
    from hybridmem.integrations import HybridmemLightningCallback  # needs lightning
    from hybridmem.integrations import check_accelerator          # an accelerate script

Each is imported on first use, so importing this package imports neither transformers nor
lightning.
"""

from __future__ import annotations

from importlib import import_module

EXPORTS: dict[str, str] = {
    "HybridmemCallback": "hybridmem.integrations.trainer",
    "HybridmemLightningCallback": "hybridmem.integrations.lightning",
    "check_accelerator": "hybridmem.integrations.accelerate",
    "NoFit": "hybridmem.integrations.check",
}


def __getattr__(name: str):
    if name in EXPORTS:
        return getattr(import_module(EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(EXPORTS)
