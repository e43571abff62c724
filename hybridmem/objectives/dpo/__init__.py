"""The DPO objective (`hybridmem.objectives`): its step in `step.py`."""
