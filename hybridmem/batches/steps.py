"""The run's steps: sample order, micro-batches, padded shapes, a few distinct buckets.

Order (`hybridmem.job.batching` says where each rule comes from):
- `random`: `torch.randperm(n, generator)` with the generator seeded `seed + epoch`, as
  accelerate's `SeedableRandomSampler.__iter__` reseeds it before torch's
  `RandomSampler.__iter__` draws (one `randperm` per epoch): the very permutation a Trainer run
  with that seed uses;
- `sequential`: dataset order;
- `group_by_length`: transformers `get_length_grouped_indices` (trainer_pt_utils.py): a
  permutation, megabatches of `min(n // (4 * B), 50) * B` indices (at least B; B =
  micro_batch x grad_accum), each sorted by length, longest first (a stable sort), the
  longest sample of all swapped to the front. Trainer gives `LengthGroupedSampler` no generator,
  so its draw comes from torch's global generator after model init: here a generator seeded
  `seed + epoch`, the same distribution, not the same draw.

Shapes: a micro-batch of `micro_batch` consecutive indices (the last one shorter unless
`drop_last`); its padded length is the longest sample truncated to `seq_len` (`pad_to=longest`)
or `seq_len` (`max_length`), rounded up to `pad_multiple`; packed (padding-free) batches are one
row of the samples' summed tokens. An optimizer step of `grad_accum` micro-batches takes its
longest one's shape (each micro-step is priced with it), the most images of any sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridmem.batches.read import Lengths

MEGABATCH_MULT = 50
"""`get_length_grouped_indices`' default `mega_batch_mult` cap (trainer_pt_utils.py)."""
BUCKETS = 8
"""Distinct padded lengths priced per batch size and image count: each tier prices (the trace
tier traces) every distinct shape once, so this bounds the cost of 100,000 samples."""


@dataclass(frozen=True, slots=True)
class Shape:
    """What one step's tensors are sized by: rows, tokens per row, images per sample."""

    batch: int
    tokens: int
    images: int
    padded: bool = False
    """A sample of the step is shorter than the padded length: its attention mask has zeros
    (`TrainingSpec.padded`: each sdpa layer then builds and saves the mask)."""


@dataclass(frozen=True)
class Steps:
    """A simulated run: per optimizer step, its true padded length and its bucketed shape."""

    shapes: tuple[Shape, ...]
    """The distinct (bucketed) shapes."""
    index: np.ndarray
    """Per step, its shape's index in `shapes`."""
    padded: np.ndarray
    """Per step, its padded tokens per row before bucketing."""
    samples: int
    """Samples seen (over every epoch the steps cover)."""
    epochs: int
    batches: int
    """Micro-batches."""

    def __len__(self) -> int:
        return len(self.index)


def order(lengths: np.ndarray, spec, epoch: int = 0) -> np.ndarray:
    """The sample indices of epoch `epoch` in the order the sampler yields them."""
    n = len(lengths)
    if spec.sampler == "sequential":
        return np.arange(n)
    import torch  # randperm: the generator's own stream, nothing else reproduces it

    generator = torch.Generator()
    generator.manual_seed(spec.seed + epoch)
    if spec.sampler == "group_by_length":
        # LengthGroupedSampler draws from torch's global generator (generator=None), which
        # Trainer.__init__'s `set_seed(seed)` seeded; the DataLoader's iterator draws its base
        # seed from it first (torch/utils/data/dataloader.py `_BaseDataLoaderIter.__init__`:
        # `_get_shared_seed`, one int64 `random_()`): epoch 0 is then the real run's draw
        # (tests/test_lengths.py runs Trainer's loader); later epochs follow what training drew
        # in between (dropout...): the same distribution, not the same draw
        torch.empty((), dtype=torch.int64).random_(generator=generator)
    perm = torch.randperm(n, generator=generator).numpy()
    if spec.sampler == "random":
        return perm
    return grouped(perm, lengths, spec.micro_batch * spec.grad_accum)


def grouped(perm: np.ndarray, lengths: np.ndarray, batch_size: int) -> np.ndarray:
    """`get_length_grouped_indices` on a drawn permutation `perm`."""
    n = len(perm)
    mult = min(n // (batch_size * 4), MEGABATCH_MULT) or 1
    size = mult * batch_size
    megas = []
    for start in range(0, n, size):
        mega = perm[start:start + size]
        # sorted(..., key=lengths, reverse=True) is stable: equal lengths keep their order
        megas.append(mega[np.argsort(-lengths[mega], kind="stable")])
    firsts = np.array([lengths[m[0]] for m in megas])
    top = int(np.argmax(firsts))  # torch.argmax: the first maximum
    megas[0] = megas[0].copy()
    megas[top] = megas[top].copy() if top else megas[0]
    megas[0][0], megas[top][0] = megas[top][0], megas[0][0]
    return np.concatenate(megas)


def plan(data: Lengths, spec, images_default: int, buckets: int = BUCKETS) -> Steps:
    """The run's steps: one epoch, or `max_steps` optimizer steps over as many epochs as they
    need (each reshuffled)."""
    tokens = data.tokens
    images = data.images if data.images is not None else np.full(len(tokens), images_default)
    b, accum = spec.micro_batch, spec.grad_accum
    per_epoch = len(tokens) // b if spec.drop_last else -(-len(tokens) // b)
    if per_epoch == 0:
        from hybridmem.errors import SpecError

        raise SpecError("lengths", data.source, reason=f"{len(tokens)} samples make no batch "
                        f"of {b} with drop_last")
    wanted = spec.max_steps * accum if spec.max_steps else per_epoch
    rows, padded, imgs, pads, seen, epochs = [], [], [], [], 0, 0
    while sum(map(len, rows)) < wanted:
        idx = order(tokens, spec, epochs)
        if spec.drop_last:
            idx = idx[:per_epoch * b]
        r, p, i, q = _micro_batches(tokens[idx], images[idx], spec)
        rows.append(r), padded.append(p), imgs.append(i), pads.append(q)
        epochs += 1
    rows_, padded_, imgs_, pads_ = (np.concatenate(x)[:wanted]
                                    for x in (rows, padded, imgs, pads))
    seen = int(min(wanted * b, epochs * len(tokens)))
    # an optimizer step of `accum` micro-batches: its longest one (ceil: a last, partial step)
    steps = -(-len(rows_) // accum)
    pad_len = np.full(steps * accum, 0, dtype=np.int64)
    pad_len[:len(padded_)] = padded_
    step_len = pad_len.reshape(steps, accum).max(axis=1)
    grid = np.zeros(steps * accum, dtype=np.int64)
    grid[:len(rows_)] = rows_
    step_rows = grid.reshape(steps, accum).max(axis=1)
    grid[:] = 0
    grid[:len(imgs_)] = imgs_
    step_imgs = grid.reshape(steps, accum).max(axis=1)
    grid[:] = 0
    grid[:len(pads_)] = pads_
    step_pads = grid.reshape(steps, accum).max(axis=1)  # a micro-batch of the step is padded
    bucketed = bucket(step_len, buckets, spec.pad_multiple)
    keys = np.stack([step_rows, bucketed, step_imgs, step_pads], axis=1)
    distinct, index = np.unique(keys, axis=0, return_inverse=True)
    shapes = tuple(Shape(int(r), int(t), int(i), bool(q)) for r, t, i, q in distinct)
    return Steps(shapes, index.reshape(-1), step_len, seen, epochs, len(rows_))


def _micro_batches(tokens: np.ndarray, images: np.ndarray, spec
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows, padded tokens per row, most images per sample, whether a sample is shorter than
    the padded length) of each micro-batch, in order."""
    b, cap = spec.micro_batch, spec.seq_len
    n = len(tokens)
    count = -(-n // b)
    clipped = np.minimum(tokens, cap)  # truncation to max_length
    pad = count * b - n
    grid = np.concatenate([clipped, np.zeros(pad, dtype=np.int64)]).reshape(count, b)
    img_grid = np.concatenate([images, np.zeros(pad, dtype=np.int64)]).reshape(count, b)
    sizes = np.full(count, b, dtype=np.int64)
    if pad:
        sizes[-1] = b - pad
    imgs = img_grid.max(axis=1)
    if spec.packing:  # padding-free: one row of every token of the micro-batch
        return np.ones(count, dtype=np.int64), grid.sum(axis=1), imgs, np.zeros(count, bool)
    longest = grid.max(axis=1) if spec.pad_to == "longest" else np.full(count, cap)
    if spec.pad_multiple:
        longest = -(-longest // spec.pad_multiple) * spec.pad_multiple
    # the rows a partial last batch lacks are not padding (they are not in the batch)
    rows = np.arange(b) < sizes[:, None]
    padded = ((grid < longest[:, None]) & rows).any(axis=1)
    return sizes, longest, imgs, padded


def bucket(padded: np.ndarray, buckets: int, multiple: int = 0) -> np.ndarray:
    """Each padded length rounded UP to one of at most `buckets` values: the distinct lengths
    when there are that few, else the longest and the lengths at evenly spaced quantiles of
    the steps (rounded up to `multiple`), so no step is priced shorter than it is and the
    longest step is priced exactly."""
    distinct = np.unique(padded)
    if len(distinct) <= buckets:
        return padded.copy()
    qs = np.quantile(padded, np.arange(1, buckets) / buckets, method="higher")
    if multiple:
        qs = -(-qs // multiple) * multiple
    edges = np.unique(np.append(np.minimum(qs, distinct[-1]), distinct[-1]))
    return edges[np.searchsorted(edges, padded, side="left")]
