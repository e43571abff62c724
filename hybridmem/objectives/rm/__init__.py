"""The RM objective (`hybridmem.objectives`): its step in `step.py`."""
