"""The GRPO objective (`hybridmem.objectives`): its step in `step.py`."""
