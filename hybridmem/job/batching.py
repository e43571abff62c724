"""How a run's batches are built from per-sample lengths: the collator and sampler fields.

The rules are Trainer's and TRL's (transformers 5.x):
- padding: `DataCollatorWithPadding` / TRL `DataCollatorForLanguageModeling` pad each batch to
  its longest sample (`padding="longest"`, the default) or to `max_length`, then round up to
  `pad_to_multiple_of`; TRL truncates every sample to `max_length` (our `seq_len`) first;
- sampler: `Trainer._get_train_sampler` (trainer.py) by `train_sampling_strategy` (older
  releases: `group_by_length`): `RandomSampler`, which accelerate's `prepare_data_loader`
  replaces with `SeedableRandomSampler` (seeded `data_seed`, else `torch.initial_seed()`, which
  Trainer's `set_seed(args.seed)` made `seed`; `+ epoch` per epoch); `SequentialSampler`; or
  `LengthGroupedSampler(train_batch_size * gradient_accumulation_steps)`;
- steps: one epoch unless `max_steps` > 0 (TrainingArguments `max_steps`), the last partial
  batch dropped with `dataloader_drop_last`.

These fields change nothing without `--lengths` (every step is then micro_batch x seq_len).
"""

from __future__ import annotations

from hybridmem.errors import SpecError

PAD_TO: tuple[str, ...] = ("longest", "max_length")
SAMPLERS: tuple[str, ...] = ("random", "sequential", "group_by_length")
HF_DEFAULT_SEED = 42
"""TrainingArguments.seed default (transformers training_args.py)."""


def _natural(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(name, value, reason="must be a non-negative integer")


def check(spec) -> None:
    """The batching fields' own checks (choices, signs)."""
    if spec.lengths is not None and (not isinstance(spec.lengths, str) or not spec.lengths):
        raise SpecError("lengths", spec.lengths, reason="give a path to a lengths file")
    if spec.pad_to not in PAD_TO:
        raise SpecError("pad_to", spec.pad_to, PAD_TO)
    if spec.sampler not in SAMPLERS:
        raise SpecError("sampler", spec.sampler, SAMPLERS)
    for name in ("pad_multiple", "seed", "max_steps"):
        _natural(name, getattr(spec, name))
    if not isinstance(spec.drop_last, bool):
        raise SpecError("drop_last", spec.drop_last, [True, False])
    if not isinstance(spec.padded, bool):
        raise SpecError("padded", spec.padded, [True, False])
    if spec.padded and spec.packing:
        raise SpecError("padded", True, [False], reason="packed batches are padding-free "
                        "(--packing)")


def sampler_from_hf(strategy: object, group_by_length: object) -> str | None:
    """Our `sampler` from TrainingArguments' `train_sampling_strategy` (transformers >= 5) or
    `group_by_length` (earlier releases); None when neither says."""
    if strategy is not None:
        if strategy not in SAMPLERS:
            raise SpecError("training_args.train_sampling_strategy", strategy, SAMPLERS,
                            reason="not priced (batch_rebalance needs the data-parallel layout)"
                            if strategy == "batch_rebalance" else None)
        return str(strategy)
    if group_by_length is not None:
        if not isinstance(group_by_length, bool):
            raise SpecError("training_args.group_by_length", group_by_length, [True, False])
        return "group_by_length" if group_by_length else "random"
    return None
