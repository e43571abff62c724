"""The SFT objective (`hybridmem.objectives`): its step in `step.py`."""
