"""The KTO objective (`hybridmem.objectives`): its step in `step.py`."""
