"""Trace a few transformer layers and repeat their alloc/free pattern for the rest (the fast path).

Why: the trace costs time per dispatched op, and a 7B-70B step is mostly the same layer run
32-80 times. Here the model is built with `b` layers per stack (a `ModuleList` of transformers
`GradientCheckpointingLayer`s: the decoder layers, the vision encoder layers), every event is
tagged with the layer it belongs to, and the full stream is rebuilt by repeating a template
block of `p` layers (p = the checkpointing period: `every:N` alternates layers, so its pattern
repeats every N layers). Results are meant to be identical to the full trace's, byte for byte.

Contexts (which layer an event belongs to):
- forward and checkpoint recompute: forward pre/post hooks on each layer;
- backward: `torch._C._current_autograd_node()` (the node the engine is running), mapped to the
  layer whose forward created it (walk of the autograd graph in the layer's forward hook);
  AccumulateGrad to its parameter's layer;
- anything else (optimizer, zero_grad, setup): a birth takes the layer of its op's first tensor
  input (foreach ops: the input at the same list position), else the previous event's; a free
  takes the layer of the freed storage.

The rebuilt stream is checked before it is trusted: the same rule applied to the `b`-layer
trace must reproduce a real trace with `b + p` layers exactly (events, sizes, labels, phases).
Where it does not (a size that depends on the layer count, e.g. clipping's stacked norms; Qwen2-VL's
packed vision blocks), or where layers are known to differ with no period (dense layers among MoE
ones, a per-layer config list that does not repeat, absolute vision feature layers), the full
trace runs instead and the notes say why. A per-layer list that repeats (Gemma 3's sliding/global
`layer_types`, Qwen2.5-VL's `fullatt_block_indexes`) makes its period part of `p`.
`HYBRIDMEM_TRACE_FULL=1` forces the full trace (tests compare both).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_iter

from hybridmem import objectives
from hybridmem.models.build import part_of
from hybridmem.job.spec import TrainingSpec, ckpt_every
from hybridmem.trace import metacache, runner
from hybridmem.trace.tracker import Storage, StorageTracker

FULL_ENV = "HYBRIDMEM_TRACE_FULL"
"""Set to 1 to force the full trace (every layer traced)."""

FIRST, LAST = 1, 2
"""Layers kept as they are at the start / end of each stack: the first layer reads the
embeddings; the last feeds the final norm, and LLaVA's `vision_feature_layer=-2` makes the last
two CLIP layers differ (the feature layer's output goes to the projector, the last one's
nowhere)."""

BEFORE, AFTER = 1, 1
"""Regular blocks kept before / after the template, so that a template copy's neighbours look
like it (a first layer that frees the embeddings' tensors numbers its storages differently)."""

# config keys that make a MoE decoder's layers differ: dense layers among sparse ones
# (Qwen3-MoE `mlp_only_layers` / `decoder_sparse_step`, modeling_qwen3_moe.py Qwen3MoeDecoderLayer;
# DeepSeek `first_k_dense_replace` / `moe_layer_freq`, modeling_deepseek_v3.py DeepseekV3DecoderLayer)
DENSE_AMONG_SPARSE = {"mlp_only_layers": lambda v: bool(v), "decoder_sparse_step": lambda v: v > 1,
                      "first_k_dense_replace": lambda v: v > 0, "moe_layer_freq": lambda v: v > 1}
LAYER_KEYS = ("depth", "num_hidden_layers")  # depth: Qwen2-VL vision (configuration_qwen2_vl.py)
_BIG = 1 << 20  # context code = stack * _BIG + layer; -1 = no layer
_UINT64_MAX = (1 << 64) - 1  # AccumulateGrad's sequence number (autograd function.h)


class NotRepeatable(runner.TraceDeclined):
    """The fast path cannot be exact here; the message says why (put in the notes)."""


@dataclass(frozen=True)
class Stack:
    """One repeated stack: its sub-config, layers in the model (`full`) and traced (`traced`)."""

    sub: str  # "" (decoder config), "text_config", "vision_config"
    full: int
    traced: int
    start: int  # first layer of the template block
    period: int

    @property
    def copies(self) -> int:
        return (self.full - self.traced) // self.period + 1


def _sub_configs(config) -> dict[str, object]:
    """The configs whose layer stacks can be shortened: a VLM's text and vision configs, else the
    decoder's own."""
    subs = {k: getattr(config, k) for k in ("text_config", "vision_config")
            if getattr(config, k, None) is not None}
    return subs or {"": config}


def _layer_key(cfg) -> str | None:
    return next((k for k in LAYER_KEYS if isinstance(getattr(cfg, k, None), int)), None)


def _period(values: list, n: int) -> int:
    """Smallest q with values[i] == values[i - q] for every layer i >= q (n: no period)."""
    keys = list(map(str, values))
    return next(q for q in range(1, n + 1) if all(keys[i] == keys[i - q] for i in range(q, n)))


def _per_layer(cfg, n: int) -> dict[str, list]:
    """Config values that name something per layer: lists of length n (`layer_types`, ...), and
    Qwen2.5-VL's `fullatt_block_indexes` as one flag per block (modeling_qwen2_5_vl.py
    Qwen2_5_VisionTransformerPretrainedModel.forward: full attention at those, window elsewhere)."""
    out = {key: list(v) for key, v in cfg.to_dict().items()  # "layer": not e.g. a patch size
           if isinstance(v, (list, tuple)) and len(v) == n and "layer" in key}
    full = getattr(cfg, "fullatt_block_indexes", None)
    if isinstance(full, (list, tuple)):
        out["fullatt_block_indexes"] = [i in set(full) for i in range(n)]
    return out


def _stack(sub: str, cfg, period: int) -> Stack | str:
    """The stack of `cfg` to shorten, or why its layers are traced in full."""
    kind = cfg.model_type
    n = getattr(cfg, _layer_key(cfg))
    for key, differs in DENSE_AMONG_SPARSE.items():
        value = getattr(cfg, key, None)
        if value is not None and differs(value):
            return f"{kind}.{key}={value}: dense and sparse layers differ"
    for key, v in cfg.to_dict().items():  # another list as long as the stack: unknown meaning
        if isinstance(v, (list, tuple)) and len(v) == n and "layer" not in key and \
                len(set(map(str, v))) > 1:
            return f"{kind}.{key} differs between layers"
    for key, values in _per_layer(cfg, n).items():
        q = _period(values, n)
        if q * 2 > n:
            return f"{kind}.{key} differs between layers with no repeating period"
        period = math.lcm(period, q)
    traced = FIRST + (BEFORE + 1 + AFTER) * period + LAST
    traced += (n - traced) % period  # same layer phase as the full model mod the period
    if n < traced + period:
        return f"{kind}: {n} layers, too few layers to repeat a period of {period}"
    return Stack(sub, n, traced, FIRST + BEFORE * period, period)


def plan(spec: TrainingSpec, config) -> list[Stack]:
    """The stacks to shorten, or NotRepeatable with the reason the full trace is needed."""
    return planned(spec, config)[0]


def planned(spec: TrainingSpec, config) -> tuple[list[Stack], list[str]]:
    """(stacks to shorten, why the other stacks are traced in full), or NotRepeatable with the
    reason the full trace is needed. A stack
    that cannot be shortened is traced in full inside both short traces: then the fast path is
    taken only if the layers it saves outnumber those it traces twice."""
    if os.environ.get(FULL_ENV, "") not in ("", "0"):
        raise NotRepeatable(f"{FULL_ENV} is set")
    if spec.train == "peft":  # e.g. AdaLoRA's per-layer ranks, layers_to_transform
        raise NotRepeatable("train='peft' adapters may differ per layer")
    if not objectives.lm_loss(spec):  # a reference copy and a generation loop outside the layers
        raise NotRepeatable(f"objective={spec.objective} is traced whole")
    period = ckpt_every(spec.grad_ckpt_policy) if spec.grad_ckpt else 1
    feature = getattr(config, "vision_feature_layer", None)
    for f in feature if isinstance(feature, (list, tuple)) else [feature]:
        if isinstance(f, int) and f >= 0:
            raise NotRepeatable(f"vision_feature_layer={feature} counts layers from the start")
    stacks, kept, why = [], 0, []
    for sub, cfg in _sub_configs(config).items():
        if _layer_key(cfg) is None:
            raise NotRepeatable(f"{cfg.model_type}: no layer count in its config")
        got = _stack(sub, cfg, period)
        if isinstance(got, Stack):
            stacks.append(got)
        else:
            why.append(got)
            kept += getattr(cfg, _layer_key(cfg))
    saved = sum(s.full - 2 * s.traced - s.period for s in stacks)  # layers not traced
    if not stacks or (kept and saved <= kept):
        raise NotRepeatable("; ".join(why) if why else "too few layers to gain from repeating them")
    return stacks, why


def _source_layer(s: Stack, layer: int, count: int) -> int:
    """Layer of the full model that layer `layer` of a `count`-layer short stack stands for."""
    return layer if layer < s.start + s.period else layer + s.full - count


def shortened(config, stacks: list[Stack], extra: int = 0):
    """A copy of `config` with each stack's layer count set to its traced count (+ extra), and
    its per-layer values those of the layers the short stack stands for."""
    config = copy.deepcopy(config)
    subs = _sub_configs(config)
    for s in stacks:
        cfg = subs[s.sub]
        n = s.traced + extra
        per_layer = _per_layer(cfg, s.full)
        setattr(cfg, _layer_key(cfg), n)
        for key, values in per_layer.items():
            picked = [values[_source_layer(s, i, n)] for i in range(n)]
            if key == "fullatt_block_indexes":
                picked = [i for i, full in enumerate(picked) if full]
            setattr(cfg, key, picked)
    return config


def layer_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """(name, ModuleList) of every list of transformers' checkpointable layers, module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.ModuleList) and len(m)
            and all(isinstance(x, GradientCheckpointingLayer) for x in m)]


def match_stacks(model, stacks: list[Stack], extra: int = 0) -> list[tuple[str, torch.nn.ModuleList, int]]:
    """(name, layers, stack index) for the model's layer lists; each stack found exactly once."""
    found = []
    for name, layers in layer_lists(model):
        part = part_of(name + ".0", getattr(getattr(model, "config", None), "model_type", None))
        sub = "vision_config" if part == "vision_tower" else (
            "text_config" if any(s.sub for s in stacks) else "")  # a VLM's: text or vision
        for i, s in enumerate(stacks):
            if s.sub == sub:
                if len(layers) != s.traced + extra:
                    raise NotRepeatable(f"{name} has {len(layers)} layers, expected "
                                        f"{s.traced + extra}")
                found.append((name, layers, i))
    if sorted(i for *_, i in found) != list(range(len(stacks))):
        raise NotRepeatable("layer stacks not found in the built model")
    return found


class LayeredTracker(StorageTracker):
    """`StorageTracker` that also records the layer context of every event (module docstring)."""

    def __init__(self, stacks: list[Stack], extra: int = 0) -> None:
        super().__init__()
        self.stacks, self.extra = stacks, extra
        self.found: list = []
        self.ctx: list[int] = []  # per event
        self.tag: list[int] = []  # per storage: context of its birth
        self.codes: dict[int, int] = {}  # id(tensor) -> context, for tensors labelled at setup
        self._layer: list[int] = [-1]
        self._starts: list[int] = []
        self._nodes: dict[int, int] = {}  # autograd sequence number -> context
        self._pending: int | None = None
        self._last = -1
        self._left = -1  # the layer whose forward just returned, until the next one starts

    @contextlib.contextmanager
    def attached(self, job):
        """Find the layer stacks of the built model, give its parameters, buffers and fp32
        masters their layer, and hook every layer's forward."""
        self.found = match_stacks(job.model, self.stacks, self.extra)
        names = param_codes(job.model, self.found)
        for name, t in [*job.model.named_parameters(), *job.model.named_buffers()]:
            if name in names:
                self.codes[id(t)] = names[name]
        for m, (_, p) in zip(job.masters, job.trainable):
            if id(p) in self.codes:
                self.codes[id(m)] = self.codes[id(p)]
        handles = self.watch_layers(self.found)
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def watch_layers(self, found) -> list:
        handles = []
        for name, layers, stack in found:
            for i, layer in enumerate(layers):
                code = stack * _BIG + i
                handles.append(layer.register_forward_pre_hook(
                    lambda m, a, k, code=code: self._enter(code, a, k), with_kwargs=True))
                handles.append(layer.register_forward_hook(
                    lambda m, a, k, out, code=code: self._leave(code, out), with_kwargs=True))
        return handles

    def _enter(self, code: int, args, kwargs) -> None:
        self._layer.append(code)
        self._left = -1
        start = -1
        for t in tree_iter((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                start = max(start, t.grad_fn._sequence_nr())
        self._starts.append(start)

    def _leave(self, code: int, out) -> None:
        start = self._starts.pop()
        self._layer.pop()
        self._left = code if self._layer[-1] < 0 else -1
        todo = [t.grad_fn for t in tree_iter(out)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None:
                continue
            seq = node._sequence_nr()
            if seq <= start or seq == _UINT64_MAX or seq in self._nodes:
                continue
            self._nodes[seq] = code
            todo.extend(f for f, _ in node.next_functions)

    def _current(self) -> int | None:
        if self._layer[-1] >= 0:
            return self._layer[-1]
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        seq = node._sequence_nr()
        if seq == _UINT64_MAX:  # AccumulateGrad: its parameter's layer
            var = getattr(node, "variable", None)
            sid = None if var is None else self._sid.get(var.untyped_storage())
            return None if sid is None else self.tag[sid]
        return self._nodes.get(seq, -1)

    # -- recording -------------------------------------------------------------------------
    def track(self, storage, category="temporary"):
        known = self._sid.get(storage)
        before = len(self.storages)
        sid = super().track(storage, category)
        if sid is not None and known is None and len(self.storages) > before:
            self._born(self._pending)
        return sid

    def _born(self, code: int | None) -> None:
        if code is None:
            code = self._current()
        if code is None:
            code = self._last
        self.tag.append(code)
        self.ctx.append(code)
        self._last = code

    def _free(self, sid: int) -> None:
        super()._free(sid)
        code = self._current()
        if code is None and self._left > 0 and self.tag[sid] == self._left - 1:
            code = self._left  # between two layers' forwards, the previous layer's storage: the
            # layer that just ran replaced it (Mixtral's layers free their input so)
        self.ctx.append(self.tag[sid] if code is None else code)

    def mark(self, phase: str, iteration: int) -> None:
        self._left = -1
        super().mark(phase, iteration)

    def add_external(self, nbytes: int, category: str) -> int:
        sid = super().add_external(nbytes, category)
        self._born(None)
        return sid

    def label(self, tensor, category, part=None):
        self._pending = self.codes.get(id(tensor))
        try:
            super().label(tensor, category, part)
        finally:
            self._pending = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = metacache.call(func, args, kwargs)
        outs = [t for t in tree_iter(out) if isinstance(t, torch.Tensor)]
        inside = self._current()
        first = args[0] if args else None
        paired = (isinstance(first, (list, tuple)) and len(first) == len(outs)
                  and all(isinstance(t, torch.Tensor) for t in first))
        if not paired and inside is None and outs:
            first = next((t for t in tree_iter((args, kwargs)) if isinstance(t, torch.Tensor)),
                         None)
        for i, t in enumerate(outs):
            if inside is None:
                src = first[i] if paired else first
                sid = None if src is None else self._sid.get(src.untyped_storage())
                self._pending = None if sid is None else self.tag[sid]
            else:
                self._pending = inside
            sid = self.track(t.untyped_storage())
            if sid is not None and self.storages[sid].op is None:
                self.storages[sid].op = func
        self._pending = None
        return out


def _code(stack: int, layer: int) -> int:
    return stack * _BIG + layer


class _Copier:
    """One pass of `extrapolate`: the trace's events re-emitted, each template block once per
    copy of its stack's period, every storage keyed by (stack, layer, role) so that a free
    finds the allocation it matches in the longer model."""

    def __init__(self, tr: LayeredTracker, stacks: list[Stack], copies: list[int]):
        self.events, self.ctx, self.tag, self.storages = tr.events, tr.ctx, tr.tag, tr.storages
        if len(self.ctx) != len(self.events) or len(self.tag) != len(self.storages):
            raise NotRepeatable("layer contexts incomplete")
        self.stacks, self.copies = stacks, copies
        self.role, seen = [0] * len(self.storages), {}
        for sid, c in enumerate(self.tag):  # the k-th storage made under one layer context
            self.role[sid] = seen.get(c, 0)
            seen[c] = self.role[sid] + 1
        self.out: list[int] = []
        self.new: list[Storage] = []
        self.keys: dict = {}
        self.pos = [0] * (len(self.events) + 1)

    @staticmethod
    def split(code: int) -> tuple[int, int]:
        return (-1, -1) if code < 0 else divmod(code, _BIG)

    def template(self, code: int) -> bool:
        s, layer = self.split(code)
        return s >= 0 and 0 <= layer - self.stacks[s].start < self.stacks[s].period

    def outside(self, s: int, layer: int) -> int:
        st = self.stacks[s]
        if layer < st.start:
            return layer
        if layer >= st.start + st.period:
            return layer + (self.copies[s] - 1) * st.period
        raise NotRepeatable("a template layer is referenced from outside its stack")

    def key(self, e: int, shift: int | None) -> tuple:
        ev = self.events[e]
        sid = ev if ev >= 0 else ~ev
        s_t, l_t = self.split(self.tag[sid])
        if s_t < 0:
            if shift:
                raise NotRepeatable("a repeated layer frees a storage outside the layers")
            return ("n", sid)
        if ev >= 0:
            return (s_t, l_t + shift if shift is not None else self.outside(s_t, l_t),
                    self.role[sid])
        s_e, l_e = self.split(self.ctx[e])
        if s_e == s_t and (shift is not None or self.template(self.tag[sid])):
            at = l_e + shift if shift is not None else self.outside(s_e, l_e)
            return (s_t, at + l_t - l_e, self.role[sid])
        return (s_t, self.outside(s_t, l_t), self.role[sid])

    def emit(self, e: int, shift: int | None) -> None:
        ev, key, out, new = self.events[e], self.key(e, shift), self.out, self.new
        if ev >= 0:
            st = self.storages[ev]
            self.keys[key] = len(new)
            out.append(len(new))
            new.append(Storage(st.nbytes, st.category, st.part, st.phase, st.iteration,
                               len(out) - 1, -1, st.op))
            return
        if key not in self.keys:
            raise NotRepeatable(f"free of {key} has no matching allocation")
        k = self.keys.pop(key)
        new[k].death = len(out)
        out.append(~k)

    def forward_block(self, i: int, j: int, s: int) -> bool:
        """Whether the block of events [i, j) of stack s runs in layer order (the neighbours
        on both sides agree), else in reverse (backward)."""
        ctx, st, n, order = self.ctx, self.stacks[s], len(self.events), []
        for k in (i - 1, j):
            if 0 <= k < n and self.split(ctx[k])[0] == s:
                before = self.split(ctx[k])[1] < st.start
                order.append(before if k == i - 1 else not before)
        if not order or len(set(order)) > 1:
            raise NotRepeatable("direction of a repeated block is ambiguous")
        return order[0]

    def run(self) -> None:
        ctx, n, i = self.ctx, len(self.events), 0
        while i < n:
            self.pos[i] = len(self.out)
            if not self.template(ctx[i]):
                self.emit(i, None)
                i += 1
                continue
            s = self.split(ctx[i])[0]
            j = i
            while j < n and self.template(ctx[j]) and self.split(ctx[j])[0] == s:
                j += 1
            shifts = [k * self.stacks[s].period for k in range(self.copies[s])]
            for shift in (shifts if self.forward_block(i, j, s) else shifts[::-1]):
                for e in range(i, j):
                    self.emit(e, shift)
            for e in range(i + 1, j):
                self.pos[e] = -1  # inside a repeated block: no mark may point here
            i = j
        self.pos[n] = len(self.out)

    def moved(self, index: int) -> int:
        if self.pos[index] < 0:
            raise NotRepeatable("a phase mark falls inside a repeated block")
        return self.pos[index]


def extrapolate(tr: LayeredTracker, stacks: list[Stack], full: list[int] | None = None,
                after: list[int] = ()) -> tuple[StorageTracker, list[int]]:
    """The event stream of the model with `full[s]` layers in stack s (default: the real
    counts), from the trace `tr` of `stacks[s].traced` layers; and `after` (event indices)
    moved onto it. Raises NotRepeatable where the rule does not apply."""
    full = [s.full for s in stacks] if full is None else full
    copier = _Copier(tr, stacks, [(n - s.traced) // s.period + 1 for s, n in zip(stacks, full)])
    copier.run()
    result = StorageTracker()
    result.storages, result.events = copier.new, copier.out
    result.marks = [(copier.moved(m), p, it) for m, p, it in tr.marks]
    result.empty_caches = [copier.moved(k) for k in tr.empty_caches]
    return result, [copier.moved(k + 1) - 1 for k in after]


def same_stream(a: StorageTracker, b: StorageTracker) -> str | None:
    """None if `a` and `b` record the same stream; else where they first differ."""
    if a.events != b.events:
        k = next((i for i, (x, y) in enumerate(zip(a.events, b.events)) if x != y),
                 min(len(a.events), len(b.events)))
        return f"event {k} of {len(a.events)} / {len(b.events)}"
    for x, y in zip(a.storages, b.storages):
        if (x.nbytes, x.category, x.part, x.phase, x.iteration) != \
                (y.nbytes, y.category, y.part, y.phase, y.iteration):
            return f"storage {x} vs {y}"
    if a.marks != b.marks or a.empty_caches != b.empty_caches:
        return "phase marks"
    return None


def weights(job, found, stacks: list[Stack]):
    """name -> how many times a parameter of the traced model stands in the full model."""
    out = {}
    for name, layers, s in found:
        st = stacks[s]
        for i in range(st.start, st.start + st.period):
            for pname, _ in layers[i].named_parameters():
                out[f"{name}.{i}.{pname}"] = st.copies
    return out


def param_codes(model, found) -> dict[str, int]:
    """Parameter / buffer name -> layer context (absent: not in a layer)."""
    codes = {}
    for name, layers, s in found:
        for i, layer in enumerate(layers):
            for pname, _ in [*layer.named_parameters(), *layer.named_buffers()]:
                codes[f"{name}.{i}.{pname}"] = _code(s, i)
    return codes


def trace(spec: TrainingSpec, config, workspace: int = 0):
    """The fast path: (tracker of the full stream, job of the short model, parameter weights,
    `after_step` indices on the full stream, category lookup, note); NotRepeatable if it cannot
    be exact here (the caller traces in full)."""
    start = time.perf_counter()
    stacks, kept = planned(spec, config)
    period = math.lcm(*(s.period for s in stacks))  # the check adds whole periods to each
    short, job = runner.trace(spec, shortened(config, stacks), backend="meta",
                              workspace=workspace, tracker=LayeredTracker(stacks))
    check, job2 = runner.trace(spec, shortened(config, stacks, period), backend="meta",
                               workspace=workspace, tracker=LayeredTracker(stacks, period))
    made, after = extrapolate(short, stacks, [s.traced + period for s in stacks], job.after_step)
    differ = same_stream(made, check) or (None if after == job2.after_step else "after_step")
    if differ:
        raise NotRepeatable(f"the repeated pattern does not reproduce a {period}-layer longer "
                            f"trace ({differ})")
    full, after = extrapolate(short, stacks, None, job.after_step)
    layers = ", ".join(f"{s.traced} + {s.traced + period} of {s.full}" for s in stacks)
    kept = "".join(f"; in full: {why}" for why in kept)
    note = (f"trace: layers traced {layers} (the rest repeat the pattern, checked on the "
            f"longer trace{kept}) in {time.perf_counter() - start:.1f} s")
    return full, job, weights(job, short.found, stacks), after, short.category_of, note
