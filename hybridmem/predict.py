"""The public Python API: `predict(spec, method=...) -> Prediction`.

The job is resolved once (`intake.resolve.resolve_once`: the model's defaults filled in, the tier
chosen and why) and priced by its tier through the tier protocol (`hybridmem.tiers`: the
analytic and the trace tier imported, the learned one registered from above). `import
hybridmem` stays fast: no tier's estimate is imported before it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hybridmem import environment
from hybridmem.errors import SpecError, UnsupportedModelError
from hybridmem.gpus import GPU
from hybridmem.intake.resolve import (  # noqa: F401  (the chooser, as the API has named it)
    METHODS, Choice, ResolvedJob, choose_method, resolve_once,
)
from hybridmem.job.schema import job_dict
from hybridmem.models.light import light_config
from hybridmem.models.loader import is_analytic, model_type_of
from hybridmem.prediction import TIER_ERROR, Prediction
from hybridmem.tiers import (  # noqa: F401  (re-exported: the tiers' rules, as named before)
    SCOPES, gpu_options, no_tier, refusal,
)
from hybridmem.tiers import estimator as tier_estimator
from hybridmem.job.spec import TrainingSpec

def estimator(method: str) -> Callable[[TrainingSpec], Prediction]:
    """The estimate function of a tier, per rank for a multi-GPU spec (`tiers.estimator`: the
    per-rank wrapper, or the tier itself where it prices ranks, `Tier.per_rank`)."""
    if method not in METHODS:
        raise SpecError("method", method, METHODS)
    return tier_estimator(method)


# Upper end of the micro-batch search: the field's bound in the job schema (no job may ask
# for more), so the search takes at most ~2 log2(65536) = 32 probes
MAX_SEARCH_BATCH = TrainingSpec.__dataclass_fields__["micro_batch"].metadata["job"].maximum


GUIDED_METHODS: frozenset[str] = frozenset({"trace"})
"""Tiers whose micro-batch search starts at the analytic tier's answer (each probe of theirs
costs a trace; the analytic tier's costs milliseconds and lands within a few micro-batches)."""


def search_max(fits: Callable[[int], bool], guess: int | None = None) -> int:
    """Largest b in [1, MAX_SEARCH_BATCH] with `fits(b)` (0 if none), `fits` monotone.

    Without a `guess`: exponential search from 1, then bisection (O(log B) probes). With one:
    probe the guess, then steps of 1, 2, 4, ... up (it fits) or down (it does not) until the
    answer is bracketed, then bisection: two probes when the guess is right, O(log error)
    when not; the same answer as without."""
    if guess is None or guess < 1:
        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi <= MAX_SEARCH_BATCH and fits(hi):
            lo, hi = hi, hi * 2
        if hi > MAX_SEARCH_BATCH:
            return lo
    else:
        guess, step = min(guess, MAX_SEARCH_BATCH), 1
        if fits(guess):
            lo = guess
            while True:
                hi = lo + step
                if hi > MAX_SEARCH_BATCH:
                    hi = MAX_SEARCH_BATCH + 1
                    if lo == MAX_SEARCH_BATCH or fits(MAX_SEARCH_BATCH):
                        return MAX_SEARCH_BATCH
                    break
                if not fits(hi):
                    break
                lo, step = hi, step * 2
        else:
            hi = guess
            while True:
                lo = max(hi - step, 1)
                if fits(lo):
                    break
                if lo == 1:
                    return 0
                hi, step = lo, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def find_max_micro_batch(spec: TrainingSpec, gpu: GPU, method: str = "analytic",
                         **tier_options: object) -> int:
    """Largest micro-batch whose predicted device peak fits `gpu` (0 if even 1 does not fit).

    Peak memory is monotone in the micro-batch (`search_max`). A trace search starts at the
    analytic tier's answer where that tier prices the family (`GUIDED_METHODS`): a handful of
    traces instead of ~2 log2(B), in the process that already imported torch once.
    """
    run = estimator(method)
    options = {**gpu_options(method, gpu), **tier_options}
    from hybridmem.objectives import micro_batch_step

    unit = micro_batch_step(spec)  # GRPO: whole groups of num_generations completions

    def fits(k: int) -> bool:
        return run(spec.with_(micro_batch=k * unit), **options).fits_within(gpu.memory_bytes)

    guess = None
    if method in GUIDED_METHODS and refusal("analytic", spec) is None:
        try:
            guess = find_max_micro_batch(spec, gpu, "analytic") // unit
        except SpecError:  # a spec only the trace tier takes: search unguided
            guess = None
    return search_max(fits, guess) * unit


def _image_values(spec: TrainingSpec) -> dict:
    """The image count and size a multimodal job was priced with where the user left them
    open: `job.images.images_in_batch`'s 1, and the family's image plan at no size (the
    tower's native side, or the processor's default resize), as "HxW" unless square. Empty for
    a text-only model, a trace-only family and `--lengths` (the file may carry the counts)."""
    from hybridmem.families.common.images import IMAGE_FAMILIES, image_plan
    from hybridmem.job.images import images_in_batch

    if spec.lengths is not None or (spec.images_per_sample is not None
                                    and spec.image_size is not None):
        return {}
    try:
        model_type = model_type_of(spec.model)
        if model_type not in IMAGE_FAMILIES or not is_analytic(model_type):
            return {}
        images = images_in_batch(spec, True)
        h, w = image_plan(light_config(spec.model)[1], spec.image_size).size
    except SpecError:  # the tier already answered; a model it priced without images
        return {}
    out = {}
    if spec.images_per_sample is None:
        out["images_per_sample"] = images
    if spec.image_size is None and images:
        out["image_size"] = h if h == w else f"{h}x{w}"
    return out


IMAGE_DEFAULTS: dict[str, str] = {
    "images_per_sample": "a multimodal model's default: one image per sample",
    "image_size": "the image as the model's processor and vision tower size it by default "
                  "(docs/vlm-families.md)"}
"""Why each `_image_values` value was taken (the echo's `defaults` lines)."""


def _over_lengths(spec: TrainingSpec, method: str, gpu: GPU | None, find_max_batch: bool,
                  tier_options: dict) -> Prediction:
    """The tier's answer over the run a lengths file makes (`hybridmem.batches.run`)."""
    from hybridmem.batches.run import simulate

    if find_max_batch:
        raise SpecError("find_max_batch", True, reason="not with --lengths (the batches "
                        "change with the micro-batch; search without --lengths)")
    run, options = estimator(method), {**gpu_options(method, gpu), **tier_options}
    return simulate(spec, method, lambda s: run(s, **options), gpu)


def predict(spec: TrainingSpec | ResolvedJob, method: str | None = None, gpu: GPU | None = None,
            find_max_batch: bool = False, **tier_options: object) -> Prediction:
    """Predict the peak memory of `spec`; with `gpu`, also whether it fits (and the max batch).

    `method`: the tier; None chooses it as the CLI does (`choose_method`). The answer's `method`
    is the tier that produced it and `extras["method_reason"]` says why. A tier that does not
    price the job (its `refusal`, or a trace that cannot run) is a one-line `SpecError` naming
    the tier that does, or saying that none does. `tier_options` go to the tier's estimate
    function (e.g. `timeline=` for the trace tier).
    """
    if find_max_batch and gpu is None:
        raise SpecError("find_max_batch", True, reason="needs a GPU (--gpu or --gpu-mem)")
    if isinstance(spec, ResolvedJob):  # resolved once by the caller (the CLI, the service)
        job = spec
        if method is not None and method != job.tier.method:
            raise SpecError("method", method, (job.tier.method,),
                            reason="the job was resolved for another tier")
    else:
        job = resolve_once(spec, method)
    spec, choice = job.spec, job.tier
    method = choice.method
    refused = refusal(method, spec)
    if refused is not None:
        raise no_tier(refused, spec, method)
    try:
        if spec.lengths is not None:  # the batches a dataset makes, step by step
            result = _over_lengths(spec, method, gpu, find_max_batch, tier_options)
        else:
            result = estimator(method)(spec, **{**gpu_options(method, gpu), **tier_options})
        max_batch = None
        if gpu is not None and find_max_batch:
            # the timeline file belongs to the spec as asked, not to the search's probes
            search_options = {k: v for k, v in tier_options.items() if k != "timeline"}
            max_batch = find_max_micro_batch(spec, gpu, method, **search_options)
    except UnsupportedModelError as err:  # the trace tier could not run the model's code
        raise no_tier(err, spec, "trace") from err
    notes = result.notes if choice.note is None else (*result.notes, choice.note)
    if max_batch == 0:  # the JSON keeps 0 (an int, a contract); the words say what it means
        from hybridmem.objectives import micro_batch_step

        notes = (*notes, f"does not fit at any micro-batch: largest micro-batch that fits "
                 f"{gpu.name}: none, micro-batch {micro_batch_step(spec)} does not fit")
    if job.defaults.get("attn") and spec.attn != "sdpa":  # the one default worth a note
        notes = (*notes, f"attn={spec.attn}: {job.defaults['attn']}")
    # a tier that answered with another one (the hybrid tier's fallbacks) says why itself
    # every answer says what job it priced, with the schema's names
    images = _image_values(spec)  # what the image was priced as, where left open
    defaults = {**job.defaults, **{k: IMAGE_DEFAULTS[k] for k in images}}
    echo = {**job_dict(spec), **images}
    echo = {**echo, "defaults": defaults} if defaults else echo
    result = dataclasses.replace(result, notes=notes, job=echo,
                                 extras={"method_reason": choice.reason, **result.extras,
                                         "environment": environment.versions()})
    if gpu is None:
        return result
    result = dataclasses.replace(result, gpu_name=gpu.name, gpu_memory_bytes=gpu.memory_bytes,
                                 max_micro_batch=max_batch)
    if result.within_error:  # the first verdict note: the one the console shows
        gib = 1 << 30
        result = dataclasses.replace(result, notes=(
            f"fits only within the error; expect OOM risk: headroom "
            f"{result.headroom_bytes / gib:.2f} GiB is less than the {result.method} tier's "
            f"stated error of {result.error_bytes / gib:.2f} GiB ({TIER_ERROR[result.method]:.1%}"
            " of the peak: its median error on real GPUs, docs/accuracy.md)", *result.notes))
    return result
