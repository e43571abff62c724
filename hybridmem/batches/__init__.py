"""Data-aware peaks: the batches a dataset really produces, step by step.

A real run does not see one `seq_len`: its collator pads each micro-batch to its longest sample
(or packs it), its sampler shuffles or groups by length, and its peak comes from the longest
batch while the caching allocator's reserved bytes grow as shapes change from step to step.

- `read`: per-sample token (and image) counts from a file (`--lengths`);
- `steps`: the sampler and collator as Trainer / TRL build them -> per-step batch shapes,
  bucketed to a few distinct ones;
- `run`: each distinct shape priced by the tier, the per-step alloc/free streams composed and
  replayed through the allocator simulator (`hybridmem.allocator`): the `lengths` answer.

docs/lengths.md says what is exact and what is approximated.
"""
