"""The ORPO objective (`hybridmem.objectives`): its step in `step.py`."""
