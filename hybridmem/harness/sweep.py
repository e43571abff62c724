"""Sweep files: a TOML description of a family of training configs, expanded and ordered.

A sweep has a `[sweep]` table (name, seed, iterations, timeout, budgets), optional custom
shapes (`[vision.NAME]`, `[decoder.NAME]` tables of HF config keys) and one or more
`[[block]]` tables. Each block lists values per axis; `sampling = "grid"` takes their product,
`"random"` draws `samples` distinct seeded points of it. Every axis value is validated on its
own (a bad one is a `SpecError` naming `block[i].axis`); combinations that cannot exist (image
tokens longer than the sequence, a projector in a decoder-only model, pairs the spec refuses)
are dropped and counted by reason. Format reference: `datasets/sweeps/README.md`.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hybridmem.job.recorded import PARALLEL_RECORDED, RECORDED, recorded_fields, recorded_parallel
from hybridmem.errors import SpecError
from hybridmem.harness import shapes
from hybridmem.harness.order import estimate_seconds, space_filling_order
from hybridmem.harness.schema import spec_hash
from hybridmem.job.images import normalize_image_size, parse_image_size
from hybridmem.models import build_graph
from hybridmem.job.parallel import PP_SCHEDULES, STRATEGIES, ParallelSpec
from hybridmem.parallel.validate import check_parallel
from hybridmem.job.spec import LoraSpec, TrainingSpec

SWEEP_KEYS: dict[str, object] = {"name": "", "seed": 0, "iterations": 3, "timeout_s": 600.0,
                                 "max_configs": None, "max_minutes": None}
"""`[sweep]` keys and their defaults (None = no budget)."""

# Axis -> default values, in the order used for grids and for the space-filling order.
AXES: dict[str, list] = {
    "model": [],  # presets / config paths; if empty, vision x decoder x gqa are used
    "vision": ["none"],
    "decoder": [],
    "gqa": [False],
    "image_size": [0],  # 0 = the tower's native size; an int (a square) or "HxW"
    "micro_batch": [1],
    "seq_len": [2048],
    "images_per_sample": [1],
    "precision": ["bf16-mixed"],
    "optimizer": ["adamw"],
    "train": ["full"],
    "lora_r": [8],
    "attn": ["sdpa"],
    "grad_ckpt": [False],
    "world_size": [1],  # ranks (GPUs); > 1 is launched through torchrun
    "strategy": ["none"],  # hybridmem.job.parallel.STRATEGIES; > 1 rank needs one
    # the loop and the techniques: one axis per recorded spec field (hybridmem/job/recorded.py)
    **{name: [default] for name, (_, default) in RECORDED.items()},
}
BLOCK_KEYS: tuple[str, ...] = ("name", "sampling", "samples", "seed", "priority",
                               "parallel") + tuple(AXES)
PARALLEL_AXES = ("world_size", "strategy", *sorted(PARALLEL_RECORDED))
"""Axes that go into the spec's `ParallelSpec`; a block's `parallel` table sets its other knobs."""
VALUE_PARTNERS: dict[str, object] = {"train": "lora", "grad_ckpt": True, "num_generations": 1}
"""Fields set beside one axis value when it is checked on its own (`_check_value`; groups of
one: `objective = "grpo"` divides any micro-batch)."""
SAMPLINGS: tuple[str, ...] = ("grid", "random")
MAX_GRID = 100_000  # grids larger than this must be sampled (`sampling = "random"`)
SPEC_AXES = ("micro_batch", "seq_len", "images_per_sample", "precision", "optimizer", "train",
             "attn", "grad_ckpt", *(r for r in RECORDED if r not in PARALLEL_RECORDED))
"""Axes that are `TrainingSpec` fields of the same name (validated by the spec itself)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepItem:
    """One config to measure: the spec (model = display label) and the model's full config."""

    label: str
    config: dict
    spec: TrainingSpec
    spec_hash: str
    block: str
    axes: tuple
    """Axis values of this config, in `AXES` order (for ordering and summaries)."""
    image_tokens: int
    est_seconds: float
    priority: int = 0
    """Blocks of higher priority run first (e.g. the few configs a run must not miss)."""

    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True)

    def runnable_spec(self) -> TrainingSpec:
        """The spec with `model` pointing at a materialised config file (what tiers take)."""
        return self.spec.with_(model=_materialize(self.config))


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    name: str
    path: str
    items: tuple[SweepItem, ...]
    """Configs in run order (space-filling, cheap first), cut to `max_configs`."""
    iterations: int
    timeout_s: float
    max_minutes: float | None
    dropped: dict[str, int] = field(default_factory=dict)
    """Reason -> number of combinations dropped as impossible."""

    def est_minutes(self) -> float:
        return sum(i.est_seconds for i in self.items) / 60


def _as_list(value: object) -> list:
    return list(value) if isinstance(value, list) else [value]


def _check_keys(table: dict, allowed, where: str) -> None:
    for key in table:
        if key not in allowed:
            raise SpecError(f"{where}.{key}", table[key], list(allowed), reason="unknown key")


def _check_layout_value(axis: str, value: object) -> None:
    """One layout axis value on its own; the whole layout is checked in `make_item`."""
    if axis == "pp_schedule":
        if value not in PP_SCHEDULES:
            raise SpecError(axis, value, PP_SCHEDULES)
    elif axis == "sequence_parallel":
        if not isinstance(value, bool):
            raise SpecError(axis, value, (True, False), reason="must be true or false")
    elif value is not None or axis not in ("pp_microbatches", "dp_shard"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(axis, value, reason="must be an integer >= 1")


def _check_value(where: str, axis: str, value: object) -> None:
    """Validate one axis value on its own, by the spec's own checks."""
    try:
        if axis in ("gqa", "grad_ckpt") and not isinstance(value, bool):
            raise SpecError(axis, value, (True, False), reason="must be true or false")
        if axis in SPEC_AXES or (axis == "image_size" and value != 0):  # 0 = native size
            # next to the partners some values need (quantize, lora-fa: train='lora'; a
            # grad_ckpt_policy: grad_ckpt), so a value is refused only for itself; what a whole
            # combination cannot be is dropped later (`make_item`)
            partners = {k: v for k, v in VALUE_PARTNERS.items() if k != axis}
            TrainingSpec(model="x", **partners, **{axis: value})
        elif axis == "lora_r":
            LoraSpec(r=value)
        elif axis == "world_size":
            ParallelSpec(world_size=value, strategy="ddp")  # DDP takes any world size
        elif axis in PARALLEL_RECORDED:
            _check_layout_value(axis, value)
        elif axis == "strategy" and value not in STRATEGIES:
            raise SpecError(axis, value, STRATEGIES)
        elif axis in ("model", "vision", "decoder") and not isinstance(value, str):
            raise SpecError(axis, value, reason="must be a name")
    except SpecError as err:
        raise SpecError(f"{where}.{axis}", value, err.choices, err.reason) from None


def _model_config(combo: dict, custom: dict, where: str) -> tuple[str, dict]:
    if combo["model"]:
        from hybridmem.models.loader import load_config_dict

        try:
            label, cfg = load_config_dict(combo["model"])
        except SpecError as err:
            raise SpecError(f"{where}.model", err.value, err.choices, err.reason) from None
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
        # LLaVA-1.5 takes only the tower's native size: build the tower at the asked size.
        # LLaVA-NeXT tiles any image size onto its native-size tower (anyres): keep the tower.
        # A Pixtral tower (pixtral-12b) takes any size (its `image_size` is the processor's
        # longest edge): the size goes to the spec only, as for Qwen-VL / Mistral-3
        if combo["image_size"] and cfg.get("model_type") == "llava" and \
                cfg.get("vision_config", {}).get("model_type") != "pixtral":
            cfg["vision_config"] = {**cfg["vision_config"],
                                    "image_size": _tower_side(combo["image_size"])}
        return label, cfg
    side = _tower_side(combo["image_size"]) if combo["vision"] != "none" else 0
    return shapes.compose(combo["vision"], combo["decoder"], combo["gqa"], side,
                          custom.get("vision"), custom.get("decoder"), field=f"{where}.vision")


def _tower_side(image_size: int | str) -> int:
    """The side a square tower (CLIP / SigLIP, built at the asked size) is built at; an `HxW`
    size is an impossible combination with it (dropped; HxW goes to families that take it)."""
    if not image_size:  # 0: the tower's native size
        return 0
    height, width = parse_image_size(image_size)
    if height != width:
        raise SpecError("image_size", image_size,
                        reason="HxW needs a family that takes it; this tower is built square")
    return height


def image_tokens_of(spec: TrainingSpec) -> int:
    """Image tokens per sample, as the model graph counts them (0 for a decoder)."""
    if not spec.images_per_sample:
        return 0
    from hybridmem.families.common.images import image_plan
    from hybridmem.job.images import check_seq_len
    from hybridmem.models.loader import load_config

    plan = image_plan(load_config(spec.model), spec.image_size)
    return check_seq_len(spec.seq_len, spec.images_per_sample, plan)


def _parallel_knobs(block: dict, where: str) -> dict:
    """The block's `parallel` table: fixed ParallelSpec knobs (bucket sizes, offload, ...)."""
    knobs = block.get("parallel", {})
    if not isinstance(knobs, dict):
        raise SpecError(f"{where}.parallel", knobs, reason="use a table of ParallelSpec fields")
    allowed = [f for f in ParallelSpec.__dataclass_fields__ if f not in PARALLEL_AXES]
    _check_keys(knobs, allowed, f"{where}.parallel")
    return knobs


def make_item(combo: dict, custom: dict, block: str, iterations: int, where: str,
              priority: int = 0, knobs: dict | None = None) -> SweepItem:
    """The item for one combination; SpecError if the combination cannot exist."""
    label, cfg = _model_config(combo, custom, where)
    multimodal = "vision_config" in cfg
    train = combo["train"]
    if not multimodal and train in ("projector", "llm+projector", "llm"):
        raise SpecError("train", train, ("full", "lora"), reason="a decoder has no projector")
    # a tower without a native size (Qwen-VL): None, the family's default
    native = cfg["vision_config"].get("image_size") if multimodal else None
    image_size = (combo["image_size"] or native) if multimodal else None
    spec = TrainingSpec(
        model=label, micro_batch=combo["micro_batch"], seq_len=combo["seq_len"],
        images_per_sample=combo["images_per_sample"] if multimodal else 0, image_size=image_size,
        precision=combo["precision"], optimizer=combo["optimizer"], train=train,
        # LLaVA-1.5 finetune_lora uses alpha = 2 r (r 128, alpha 256)
        lora=LoraSpec(r=combo["lora_r"], alpha=2.0 * combo["lora_r"]) if train == "lora" else None,
        attn=combo["attn"], grad_ckpt=combo["grad_ckpt"],
        **recorded_fields(combo), parallel=_parallel(combo, knobs or {}, where))
    check_parallel(spec)
    if spec.parallel.model_parallel:
        # the child launches tp / cp (x FSDP2) and pipeline ranks through torchrun
        # (`distributed.model_parallel`); expert layouts are refused in one line
        from hybridmem.harness.ranks import check_measurable

        check_measurable(spec.parallel, spec.attn)
    runnable = spec.with_(model=_materialize(cfg))
    tokens = image_tokens_of(runnable)  # SpecError unless a text token fits beside them
    build_graph(runnable)  # SpecError for what the model graph refuses (dropped as impossible)
    axes = tuple(combo[a] for a in AXES)
    if train != "lora":  # the rank means nothing then: do not let it count as a new axis value
        axes = tuple(0 if a == "lora_r" else v for a, v in zip(AXES, axes))
    est = estimate_seconds(cfg, spec.micro_batch * spec.seq_len, iterations, spec.grad_ckpt,
                           launched=spec.parallel.strategy != "none"
                           or spec.parallel.model_parallel)
    return SweepItem(label=label, config=cfg, spec=spec, spec_hash=spec_hash(spec.to_dict(), cfg),
                     block=block, axes=axes, image_tokens=tokens, est_seconds=est,
                     priority=priority)


def _parallel(combo: dict, knobs: dict, where: str) -> ParallelSpec:
    """The ParallelSpec of a combination; a bad knob value is the block's error, a strategy that
    does not go with the world size an impossible combination (dropped)."""
    try:
        return ParallelSpec(world_size=combo["world_size"], strategy=combo["strategy"],
                            **recorded_parallel(combo), **knobs)
    except SpecError as err:
        name = err.field.removeprefix("parallel.")
        if name in knobs:
            raise SpecError(f"{where}.parallel.{name}", err.value, err.choices, err.reason) from None
        raise
    except TypeError as err:  # a knob of the wrong kind that the dataclass cannot take
        raise SpecError(f"{where}.parallel", knobs, reason=str(err)) from None


def _materialize(cfg: dict) -> str:
    from hybridmem.models.loader import materialize_config

    return materialize_config(json.dumps(cfg, sort_keys=True))


def _block_axes(block: dict, where: str) -> dict[str, list]:
    axes = {a: _as_list(block.get(a, d)) for a, d in AXES.items()}
    if not axes["model"] and not axes["decoder"]:
        raise SpecError(f"{where}.decoder", None, sorted(shapes.DECODERS),
                        reason="give `model` (presets/paths) or `decoder` (+ `vision`)")
    if axes["model"]:
        axes["vision"], axes["decoder"], axes["gqa"] = ["none"], [""], [False]
    else:
        axes["model"] = [""]
    for axis, values in axes.items():
        if not values:
            raise SpecError(f"{where}.{axis}", [], reason="needs at least one value")
        for v in values:
            if v != "" and not (axis == "vision" and v == "none"):
                _check_value(where, axis, v)
    # one form per size (an int for a square, "HxW" else): "448x448" and 448 are one axis value
    axes["image_size"] = list(dict.fromkeys(v and normalize_image_size(v)
                                            for v in axes["image_size"]))
    return axes


def _indices(sizes: list[int], block: dict, seed: int, where: str):
    total = math.prod(sizes)
    sampling = block.get("sampling", "grid")
    if sampling not in SAMPLINGS:
        raise SpecError(f"{where}.sampling", sampling, SAMPLINGS)
    if sampling == "grid":
        if total > MAX_GRID:
            raise SpecError(f"{where}.sampling", "grid", SAMPLINGS,
                            reason=f"{total} combinations; use random sampling")
        yield from range(total)
        return
    samples = block.get("samples")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
        raise SpecError(f"{where}.samples", samples, reason="random sampling needs a positive integer")
    rng, seen = random.Random(seed), set()
    for _ in range(min(total, 50 * samples)):  # bounded: infeasible points are skipped
        if len(seen) >= total:
            return
        i = rng.randrange(total)
        if i not in seen:
            seen.add(i)
            yield i


def _decode(index: int, sizes: list[int]) -> list[int]:
    out = []
    for size in reversed(sizes):
        index, r = divmod(index, size)
        out.append(r)
    return out[::-1]


def expand_block(block: dict, index: int, custom: dict, seed: int, iterations: int,
                 dropped: Counter) -> list[SweepItem]:
    where = f"block[{index}]"
    if not isinstance(block, dict):
        raise SpecError(where, block, reason="must be a table")
    _check_keys(block, BLOCK_KEYS, where)
    name = str(block.get("name", where))
    priority = block.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise SpecError(f"{where}.priority", priority, reason="must be an integer")
    axes = _block_axes(block, where)
    knobs = _parallel_knobs(block, where)
    if max(axes["world_size"]) > 1 and "strategy" not in block:
        raise SpecError(f"{where}.strategy", None, STRATEGIES[1:],
                        reason="world_size > 1 needs a data-parallel strategy axis")
    names, values = list(axes), list(axes.values())
    sizes = [len(v) for v in values]
    want = block.get("samples") if block.get("sampling") == "random" else None
    items: list[SweepItem] = []
    seen: set[str] = set()
    for i in _indices(sizes, block, int(block.get("seed", seed + index)), where):
        combo = {n: values[a][k] for a, (n, k) in enumerate(zip(names, _decode(i, sizes)))}
        try:
            item = make_item(combo, custom, name, iterations, where, priority, knobs)
        except SpecError as err:
            if err.field.startswith(where):
                raise  # a bad value, not a bad combination
            dropped[f"{err.field}: {err.reason or 'invalid'}"] += 1
            continue
        if item.spec_hash not in seen:
            seen.add(item.spec_hash)
            items.append(item)
        if want is not None and len(items) >= want:
            break
    return items


def _read_toml(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as err:
        raise SpecError("sweep", str(path), reason=f"cannot read it ({err.strerror})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError("sweep", str(path), reason=f"malformed TOML: {err}") from None


def _custom_shapes(data: dict) -> dict:
    custom = {}
    for kind in ("vision", "decoder"):
        table = data.get(kind, {})
        if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
            raise SpecError(kind, table, reason=f"use [{kind}.NAME] tables of HF config keys")
        custom[kind] = table
    return custom


def load_sweep(path: str | Path) -> Sweep:
    """Parse, validate, expand and order a sweep file."""
    path = Path(path)
    data = _read_toml(path)
    _check_keys(data, ("sweep", "vision", "decoder", "block"), "sweep file")
    head = data.get("sweep", {})
    _check_keys(head, SWEEP_KEYS, "sweep")
    opts = {**SWEEP_KEYS, **head}
    for key in ("seed", "iterations", "max_configs"):
        v = opts[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise SpecError(f"sweep.{key}", v, reason="must be a non-negative integer")
    if opts["iterations"] < 3:
        raise SpecError("sweep.iterations", opts["iterations"],
                        reason="at least 3 (optimizer state appears in step 1; docs/design.md)")
    for key in ("timeout_s", "max_minutes"):
        v = opts[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise SpecError(f"sweep.{key}", v, reason="must be a positive number")
    blocks = data.get("block")
    if not isinstance(blocks, list) or not blocks:
        raise SpecError("block", blocks, reason="a sweep needs at least one [[block]]")
    custom, dropped = _custom_shapes(data), Counter()
    items: dict[str, SweepItem] = {}
    for i, block in enumerate(blocks):
        for item in expand_block(block, i, custom, opts["seed"], opts["iterations"], dropped):
            items.setdefault(item.spec_hash, item)
    ordered: list[SweepItem] = []
    for priority in sorted({it.priority for it in items.values()}, reverse=True):
        pool = [it for it in items.values() if it.priority == priority]
        order = space_filling_order([it.axes for it in pool], [it.est_seconds for it in pool])
        ordered += [pool[i] for i in order]
    ordered = tuple(ordered[: opts["max_configs"]])
    return Sweep(name=opts["name"] or path.stem, path=str(path), items=ordered,
                 iterations=opts["iterations"], timeout_s=float(opts["timeout_s"]),
                 max_minutes=opts["max_minutes"], dropped=dict(dropped))


__all__ = ["AXES", "Sweep", "SweepItem", "load_sweep"]
