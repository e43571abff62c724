"""What the families' closed forms share, below the tiers: the activation primitives
(`activations.py`: `Ctx`, `Acts`, what a linear / attention / LoRA saves), eager attention's
high points (`eager_top.py`) and the registry-driven image rule (`images.py`). No family is
declared here."""
