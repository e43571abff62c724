"""What a training job is, owned once: every tier reads these rules, none keeps its own copy.

One module per concern, each the single source that the analytic tier (`hybridmem/analytic/`),
the trace tier (`hybridmem/trace/`), the per-rank layer (`hybridmem/parallel/`), the CUDA
harness (`hybridmem/harness/`) and the learned tier (`hybridmem/learned/`) import:

- optimizers: each optimizer's state layout, step temporaries and torch constructor, and the
  names TrainingArguments' `optim` gives them;
- memory-saving techniques users switch on (quantised base weights, fused / chunked
  cross-entropy, activation offloading, optimizer-in-backward, packing): what each changes.

Adding an optimizer or a technique is one module here plus its tests (docs/design.md, "Job").
"""
