"""`estimate(spec) -> Prediction`: the analytic tier, per layer and per factor, peak over a
timeline.

Which tensors need grads follows autograd: a layer keeps activations only if its input
requires grad or it has parameters that get grads (a frozen vision tower under
`llm+projector` keeps nothing; a frozen LM under `projector` still keeps what the backward to
the projector needs).
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from hybridmem.analytic import objectives, offloaded, packed, sac, scope
from hybridmem import objectives as objective_plugins
from hybridmem.objectives import rules as objective_rules
from hybridmem.families.common import activations as A
from hybridmem.allocator.alloc import t
from hybridmem.families import family, layer_kind, target
from hybridmem.analytic.events import MLP_ALL, build as build_events
from hybridmem.allocator.reserved import (
    FROM_GPU, allocator_extras, bounded, capacity_notes, capacity_source, gpu_capacity,
)
from hybridmem.allocator.overheads import (
    CUBLAS_HANDLES_TRAINING,
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_DEFAULT,
    cublas_workspace,
    workspace_note,
)
from hybridmem.analytic.states import (
    LayerStates,
    clip_temporary,
    layer_states,
    optimizer_shared_bytes,
    optimizer_temporary,
)
from hybridmem.analytic.timeline import Point, Statics, Step, peak, walk
from hybridmem.categories import empty_breakdown
from hybridmem.job.optimizers import paged_notes
from hybridmem.errors import SpecError
from hybridmem.environment import installed
from hybridmem.gpus import GPU
from hybridmem.techniques.quantize import quant_of
from hybridmem import techniques
from hybridmem.techniques import Technique, head_of, loss_of
from hybridmem.families.defaults import as_job
from hybridmem.models import ModelGraph, build_graph
from hybridmem.models.graph import Layer
from hybridmem.prediction import ModuleMemory, Peak, Prediction
from hybridmem.job.precision import AXES, adapter_bytes, casts_weights
from hybridmem.job.spec import ATTENTIONS, POLICIES, TrainingSpec, ckpt_layer

@dataclass(frozen=True, slots=True)
class Priced:
    module: str
    layer: Layer
    states: LayerStates
    step: Step


def loss_applied(spec: TrainingSpec) -> Technique | None:
    """The job's loss replacement (`techniques.loss_of`) where it changes the model: a model
    the library skips trains unchanged (Liger's unknown types), one it patches with what is not
    priced is a SpecError (`Technique.applies`)."""
    technique = loss_of(spec)
    if technique is None:
        return None
    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict(spec.model)  # the JSON: no transformers import for two fields
    text = (data.get("text_config") or {}).get("model_type")
    return technique if technique.applies(target(data["model_type"], text)) else None


def context(spec: TrainingSpec) -> A.Ctx:
    loss = loss_applied(spec)
    policy = POLICIES[spec.precision]
    amp = casts_weights(spec.precision)
    autocast = AXES[spec.precision].autocast != "none"
    quant = quant_of(spec)
    if quant is not None and quant.kbit_prep and policy.compute_bytes == 2 and not autocast:
        # prepare_model_for_kbit_training casts every unquantised param to fp32 and no autocast
        # runs: embeddings, norms, attention and the adapters run in fp32; only the 4-bit
        # matmuls run in their compute dtype (`quant_transients`)
        policy = POLICIES["fp32"]
    elif quant is not None and quant.kbit_prep and policy.param_bytes == 2 and autocast:
        # ... and under autocast (`bf16-autocast`) the fp32 params run as `bf16-mixed`'s
        policy, amp = POLICIES["bf16-mixed"], True
    if spec.attn == "flash_attention_2" and policy.compute_bytes == 4:
        raise SpecError("attn", spec.attn, [a for a in ATTENTIONS if a != spec.attn],
                        reason="FlashAttention-2 runs only in fp16/bf16, not precision='fp32'")
    return A.Ctx(e=policy.compute_bytes, stream=4 if amp else policy.param_bytes, amp=amp,
                 autocast=autocast,
                 attn=spec.attn, lora_r=spec.lora.r if spec.lora else 0,
                 lora_dropout=spec.lora.dropout if spec.lora else 0.0, ckpt=spec.grad_ckpt,
                 dora=bool(spec.lora and spec.lora.use_dora),
                 frozen_a=spec.optimizer == "lora-fa", quant=quant,
                 liger=loss is not None and loss.NAME == "liger",
                 ce_chunks=spec.chunked_ce, param=policy.param_bytes,
                 cce=loss is not None and loss.NAME == "cce",
                 adapter=adapter_bytes(spec.adapter_dtype) or policy.param_bytes,
                 objective=spec.objective, prompt=objective_plugins.prompt_length(spec),
                 ref_model=objective_plugins.ref_model_of(spec), head=head_of(spec, loss),
                 trl_head=objective_plugins.fused_head(spec, installed("trl")),
                 padded=spec.padded, score_head=objective_plugins.of(spec).SCORE_HEAD)


def _acts(layer: Layer, c: A.Ctx, need_in: bool, need_w: bool, tied_grad: int,
          merged: bool) -> A.Acts:
    acts = _formula_acts(layer, c, need_in, need_w, tied_grad, merged)
    # the collator's mask: TRL's, or a padded batch's (`TrainingSpec.padded`)
    padded = c.trl_head or objective_plugins.REGISTRY[c.objective].PADDED or c.padded
    if padded and layer.kind == "decoder_layer" and c.attn == "sdpa" and acts.saved:
        acts = objectives.padded_sdpa_mask(layer, c, acts)
    if layer.quantized and layer.kind != "decoder_layer" and layer.runs:
        # vision tower / projector linears: the dequantised weight in their forward
        d = layer.dims
        tokens = d.get("n", d.get("b", 1)) * d.get("t", d.get("s", 1))
        q_fwd, _, _ = A.quant_transients(layer, c, tokens, {})
        if sum(q_fwd) > acts.fwd_extra:
            acts = replace(acts, fwd_extra=sum(q_fwd), fwd_parts=q_fwd)
    return acts


def _formula_acts(layer: Layer, c: A.Ctx, need_in: bool, need_w: bool, tied_grad: int,
                  merged: bool) -> A.Acts:
    # the family's closed form (`Family.layer_kinds`); an unregistered kind is an error
    formula = layer_kind(layer.formula or layer.kind).acts
    if layer.kind == "embedding":
        return formula(layer, c, need_in, need_w, tied_grad, merged)
    if layer.kind == "rotary":
        return formula(layer, c, need_in)
    return formula(layer, c, need_in, need_w)


MLP_OUT = ("mlp.down_proj.", "mlp.fc2.")


def _mlp_grads(layer: Layer, policy) -> tuple[int, int]:
    """Grad bytes of (the MLP output projection, the whole MLP half) of a transformer layer."""
    def grads(prefixes):
        return sum(t(p.numel, p.itemsize or policy.grad_bytes) for p in layer.grad_tensors
                   if p.name.startswith(prefixes))
    return grads(MLP_OUT), grads(MLP_ALL)


def _grad_max(layer: Layer, policy, tied: bool) -> tuple[int, int]:
    """Largest grad tensor of (the MLP half, the rest) of a layer: what an accumulating
    micro-step's backward makes before AccumulateGrad adds it in place. A tied embedding's
    new grad is already its formula's `bwd_extra` (the second buffer), so it is left out."""
    sizes = ([], [])
    for p in layer.grad_tensors:
        if tied and layer.kind == "embedding":
            continue
        sizes[not p.name.startswith(MLP_ALL)].append(t(p.numel, p.itemsize or policy.grad_bytes))
    return max(sizes[0], default=0), max(sizes[1], default=0)


def price(graph: ModelGraph, spec: TrainingSpec) -> list[Priced]:
    """Every layer with its states, activations and flags, in forward order."""
    c = context(spec)
    policy = POLICIES[spec.precision]
    quant = quant_of(spec)
    embed = next(l for m, l in graph.layers() if l.kind == "embedding")
    tied_w = graph.tied_embeddings and embed.gets_grads
    tied_grad = t(embed.num_params, policy.grad_bytes) if tied_w else 0
    lm_layers = graph.module("language_model").layers
    # transformers' activation_checkpointing_enable calls enable_input_require_grads: every
    # input embedding's output requires grad (modeling_utils._activation_checkpointing_enable)
    input_grads = spec.grad_ckpt
    flow = {"vision": False, "image": False, "lm": False}
    out = []
    ordinal = 0  # running count of checkpointable layers, as transformers counts them
    for mname, layer in graph.layers():
        st = layer_states(layer, policy, spec.optimizer, quant)
        # a modules_to_save copy trains in place of the frozen original: its input is saved
        need_w = layer.gets_grads or (bool(layer.copies) and layer.runs)
        lora = bool(layer.lora) and layer.runs
        if mname == "vision_tower":
            need_in = flow["vision"]
            hooked = input_grads and family(graph.model_type).tower_input_grads
            if layer.runs and layer.on_grad_path and (need_in or need_w or hooked):
                flow["vision"] = True
        elif mname == "multi_modal_projector":
            need_in = flow["vision"]
            flow["image"] = layer.runs and (need_in or need_w)
        elif mname == "image_newline":
            need_in = flow["image"]
            flow["image"] |= need_w
        elif layer.kind == "embedding":
            need_in = False
            flow["lm"] = need_w or input_grads or (flow["image"] and graph.image_tokens > 0)
        elif layer.kind == "rotary":
            need_in = flow["lm"] or any(l.gets_grads or l.lora or l.copies for l in lm_layers)
        elif layer.kind == "lm_head":
            need_in = flow["lm"]
            need_w = need_w or tied_w
        else:
            need_in = flow["lm"]
            flow["lm"] |= need_w or lora
        acts = _acts(layer, c, need_in, need_w, tied_grad, graph.image_tokens > 0)
        if layer.kind == "embedding" and graph.image_tokens and flow["lm"]:
            acts = replace(acts, saved=acts.saved + A.image_merge(graph.micro_batch,
                                                                 graph.seq_len))
        grad, waste = st.grad, st.waste_grad
        if tied_w and layer.kind == "embedding":
            grad, waste = grad - tied_grad, 0      # the tied weight's grad appears at lm_head
        if tied_w and layer.kind == "lm_head":
            grad += tied_grad
        ckpt = False
        if layer_kind(layer.kind).checkpointed:
            ckpt = ckpt_layer(spec, ordinal)  # --grad-ckpt-policy: full or every:N
            ordinal += 1
        tie = (tied_grad if layer.kind == "lm_head" else -tied_grad) \
            if tied_w and layer.kind in ("lm_head", "embedding") else 0
        graded = layer.gets_grads or lora
        step = Step(acts=acts, ckpt=ckpt, grad=grad, grad_waste=waste,
                    grad_mlp=((0, grad) if layer.kind == "lm_head" else _mlp_grads(layer, policy))
                    if graded else (0, 0),
                    on_path=layer.on_grad_path,
                    grad_max=_grad_max(layer, policy, tied_w) if graded else (0, 0), tie=tie,
                    state=st.optimizer - st.master,
                    step_temp=max((optimizer_temporary(spec.optimizer, [x]) for x in st.stepped),
                                  default=0))
        out.append(Priced(mname, layer, st, step))
    return out


def batch_bytes(graph: ModelGraph, spec: TrainingSpec) -> int:
    """input_ids and labels (int64) and pixel_values, alive for the whole iteration.

    No attention mask: an unpadded batch, for which HF takes the causal kernel path (the trace
    tier's batch is the same, `hybridmem.trace.inputs`); a `padded` one adds the collator's
    int64 mask."""
    tokens = t(graph.micro_batch * graph.seq_len, A.INT64)
    out = 2 * tokens
    if spec.padded and objective_plugins.lm_loss(spec) and not objective_plugins.fused_head(
            spec, installed("trl")):
        out += tokens  # the collator's int64 attention mask (`spec.padded`)
    pix = POLICIES[spec.precision].param_bytes  # the model's dtype: fp32 under autocast
    # the processor's pixel inputs, as the tower layers that read them price them
    # (`LayerKind.pixel_bytes`: crops, packed patches and their grids, Idefics3's mask)
    out += sum(lk.pixel_bytes(layer, graph, pix) for _, layer in graph.layers()
               if (lk := layer_kind(layer.kind)).pixel_bytes is not None)
    if graph.image_tokens and family(graph.model_type).text_extras is not None:
        out += tokens  # token type ids (b, s) int64 (`Family.text_extras`, families.common.images.text_inputs)
    return out


def _modules(graph: ModelGraph, priced: list[Priced]) -> tuple[ModuleMemory, ...]:
    """Per top-level module: params, and bytes of params, grads (all of them, as at the step),
    optimizer state, and activations carried from the forward into the backward (for
    checkpointed layers, their inputs)."""
    out = []
    for m in graph.modules:
        rows = [p for p in priced if p.module == m.name]
        out.append(ModuleMemory(
            name=m.name, params=sum(p.states.param_count for p in rows),
            trainable_params=sum(p.states.trainable_count for p in rows),
            param=sum(p.states.param for p in rows), grad=sum(p.states.grad for p in rows),
            optimizer=sum(p.states.optimizer for p in rows),
            activation=sum(p.step.kept - p.step.released_at_forward_end for p in rows)))
    return tuple(out)


def _notes(graph: ModelGraph, spec: TrainingSpec, gpu: GPU | None = None,
           ws: int = CUBLAS_WORKSPACE_BYTES) -> tuple[str, ...]:
    notes = [
        f"context: {CUDA_CONTEXT_DEFAULT >> 20} MiB is a default (docs/design.md: 0.3-0.6 GiB), "
        "not a measurement",
        workspace_note(gpu, ws),
        "fragmentation: reserved - allocated of an approximate alloc/free stream of two "
        "iterations replayed through the caching-allocator simulator (PYTORCH_ALLOC_CONF "
        "respected; allocated stays the closed form's), kept non-decreasing in the "
        "micro-batch; within ~2 points of the trace tier's reserved peak on 7B models",
        ("batch: padded (the collator's attention mask; each sdpa layer saves the "
         "(b, 1, s, s) mask)" if spec.padded else "batch: unpadded (no attention mask)")
        + ", loss over every position with fp32 logits (transformers ForCausalLMLoss)",
    ]
    patches = next((l.dims["n"] for m, l in graph.layers() if layer_kind(l.kind).packed), 0)
    if graph.image_tokens:
        seen = (f"{patches} patches in one packed sequence" if patches
                else f"{graph.vision_batch} crop(s)")
        notes.append(f"{graph.image_tokens} of the {graph.seq_len} tokens per sample are image "
                     f"tokens; the vision tower encodes {seen} per step")
    if spec.parallel.world_size > 1 or spec.parallel.strategy != "none":
        notes.append("parallelism is not modelled by the analytic tier yet: one unsharded GPU")
    loss = head_of(spec) or loss_of(spec)
    if loss is not None:  # its note, or why it leaves this model unchanged
        notes.append(loss.note(spec, graph.model_type, loss_applied(spec) is not None))
    if spec.attn == "flash_attention_2":
        notes.append("flash_attention_2: saved tensors as flash-attn's (q, k, v, out, lse); "
                     "its backward's fp32 dq_accum is counted, softmax_d is not")
    if spec.precision == "bf16-master":
        notes.append("bf16-master: fp32 master weights + fp32 state; DeepSpeed's extra fp32 "
                     "gradient buffers are not counted")
    quant = quant_of(spec)
    if quant is not None:
        notes.append(f"quantize {quant.method}: bitsandbytes weights on every Linear but "
                     f"{', '.join(quant.skip) or 'none'} (docs/quantize.md); dequantised "
                     "weight as a forward/backward temporary"
                     + ("; kbit prep: unquantised params fp32" if quant.kbit_prep else ""))
    if spec.train == "lora":
        dtype = ("fp32, PEFT default" if spec.adapter_dtype == "fp32"
                 else f"{spec.adapter_dtype}, the weights' dtype")
        named = (f"the modules full-matching {spec.lora.target_regex!r} (peft's rule)"
                 if spec.lora.target_regex is not None else ", ".join(sorted(
                     {t.name.split(".lora_")[0].rsplit(".", 1)[-1] for _, l in graph.layers()
                      for t in l.lora if ".lora_A" in t.name})))
        vision = any(m.name not in ("language_model", "lm_head") for m in graph.modules)
        notes.append(f"LoRA adapters ({dtype}) on {named}"
                     + (": language-model linears only (the vision tower and projector get "
                        "none)" if vision else ""))
        if spec.lora.use_dora:
            notes.append("DoRA: fp32 magnitude vectors; per adapted linear the base and lora_B "
                         "outputs are saved and the fp32 full weight W + scale B@A is built "
                         "in every forward (peft/tuners/lora/dora.py)")
        if spec.optimizer == "lora-fa":
            notes.append("lora-fa (peft create_lorafa_optimizer): lora_A frozen (no grad, no "
                         "state, its input not saved); AdamW state on lora_B; the step's "
                         "bf16 gradient projection assumes a bf16-capable GPU")
        if spec.lora.modules_to_save:
            notes.append(f"modules_to_save {', '.join(spec.lora.modules_to_save)}: a trainable "
                         "copy in the base dtype, the original frozen")
    return tuple(notes)


def _master_grads(priced: list[Priced], spec: TrainingSpec) -> int:
    """bf16-master: `master.grad = param.grad.float()` before each step (DeepSpeed
    bf16_optimizer keeps fp32 gradients for its fp32 master weights): a new fp32 tensor for a
    bf16 parameter, the same tensor for an fp32 one (LoRA adapters)."""
    if not POLICIES[spec.precision].master_bytes:
        return 0
    return sum(t(s.numel, 4) for p in priced for s in p.states.stepped)


def timeline(spec: TrainingSpec, workspace: int = CUBLAS_WORKSPACE_BYTES
             ) -> tuple[ModelGraph, list[Priced], list[Point]]:
    """The graph, every priced layer and every timeline point of two iterations; `workspace`:
    bytes of one cuBLAS workspace (`overheads.cublas_workspace`); `setup` fills the model's
    defaults (the walk reads only what it returns)."""
    graph, priced, st = setup(spec, workspace)
    return graph, priced, walk([p.step for p in priced], st)


def _config_key(model: str) -> str:
    """The model's config as text: the caches below are keyed by it as well as by the spec, so
    a config.json edited between two answers of one process is priced afresh."""
    import json

    from hybridmem.models.loader import load_config_dict

    return json.dumps(load_config_dict(model)[1], sort_keys=True, default=str)


def setup(spec: TrainingSpec, workspace: int = CUBLAS_WORKSPACE_BYTES
           ) -> tuple[ModelGraph, list[Priced], Statics]:
    """The analytic tier's public pricing entry: the graph, the priced layers (`Priced`: each
    layer's states and activation step) and the statics (`Statics`: the job-wide bytes) of
    `spec`. The sharding layer (`parallel.stream`, `parallel.ranks`) prices a rank's narrow
    or single-GPU spec through it and rewrites the result, so it is part of the tier's API,
    not an internal. Cached per (spec, workspace,
    model config): one answer prices the same spec several times (its timeline, its replayed
    stream, the micro-batch search, `--gpu`'s advice). Callers do not mutate what it returns
    (frozen records in a list)."""
    spec = as_job(spec)  # a Job as it is; a plain spec (a script, a test): its defaults filled
    return _setup_cached(spec, workspace, _config_key(spec.model))


@lru_cache(maxsize=32)
def _setup_cached(spec: TrainingSpec, workspace: int, config_key: str
                  ) -> tuple[ModelGraph, list[Priced], Statics]:
    refused = scope.refusal(spec)  # PEFT methods, families and MoE settings it does not price
    if refused is not None:
        raise refused
    g = techniques.graph_spec(spec)  # packing's one row (techniques.packing)
    graph = build_graph(g if g is not spec else objectives.graph_spec(spec))  # objectives.rows
    graph = objectives.with_score_head(graph, spec)  # the reward model's (1, hidden) head
    techniques.check_batch(spec, graph.vision_batch)
    priced = packed.apply(price(graph, spec), spec, POLICIES[spec.precision].compute_bytes)
    priced = sac.apply(priced, spec, context(spec))  # --grad-ckpt-policy ops (techniques.sac)
    priced = offloaded.apply(priced, spec)  # activation offloading (techniques.offload)
    stepped = [s for p in priced for s in p.states.stepped]
    if not stepped:
        raise SpecError("train", spec.train, reason="no parameter receives a gradient "
                        "(e.g. train='projector' with images_per_sample=0)")
    master = sum(p.states.master for p in priced)
    shared = optimizer_shared_bytes(spec.optimizer, stepped)
    ws = workspace
    st = Statics(
        param=sum(p.states.param for p in priced) + objectives.reference_param_bytes(priced,
                                                                                   spec),
        ref_forward=objectives.reference_forward(priced, spec, context(spec)),
        **objectives.generation(priced, spec, context(spec)),
        master=master,
        state=sum(p.states.optimizer for p in priced) - master + shared,
        opt_temp=optimizer_temporary(spec.optimizer, stepped),
        inputs=batch_bytes(graph, spec) + packed.position_ids_bytes(spec)
        + objectives.batch_bytes(spec),
        workspace_first=ws, workspace=CUBLAS_HANDLES_TRAINING * ws,
        waste_param=sum(p.states.waste_param for p in priced),
        waste_optimizer=sum(p.states.waste_optimizer for p in priced),
        master_grads=_master_grads(priced, spec), in_backward=spec.optimizer_in_backward,
        **_loop(graph, spec, stepped))
    return graph, priced, st


def _loop(graph: ModelGraph, spec: TrainingSpec, stepped) -> dict:
    """The `Statics` of the training loop: what a custom loop's output object holds
    (the logits as the lm_head returns them, in the compute dtype; the fp32 loss), the
    accumulation steps, the clipping temporaries."""
    custom = spec.loop == "custom"
    head = next(l for m, l in graph.layers() if l.kind == "lm_head").dims
    e = POLICIES[spec.precision].compute_bytes
    loss = loss_applied(spec)  # a loss replacement's output keeps its own logits, or none
    kept = None if loss is None else loss.kept_logits(spec, head["b"], head["s"],
                                                      head["vocab"], e)
    logits = t(head["b"] * head["s"] * head["vocab"], e) if kept is None else sum(
        t(n, size) for n, size in kept)
    return {"custom": custom, "logits": logits if custom else 0,
            "loss": t(1, A.FP32) if custom else 0, "grad_accum": spec.grad_accum,
            "clip_temp": clip_temporary(stepped) if spec.max_grad_norm else 0}


def _events(spec: TrainingSpec, workspace: int = CUBLAS_WORKSPACE_BYTES) -> list[tuple]:
    """The approximate alloc/free stream of two iterations of `spec` (`events.py`)."""
    _, priced, st = setup(spec, workspace)
    return build_events(priced, spec, st)


def stream(spec: TrainingSpec, workspace: int = CUBLAS_WORKSPACE_BYTES
           ) -> tuple[list[tuple], list[tuple[int, str, int]]]:
    """(event stream, phase marks) of `spec` (`events.build`), cached per (spec, workspace,
    model config): the single-GPU replay and each rank's rewritten stream (`parallel.stream`)
    start from the same one. Callers read it; they never change it."""
    return _stream_cached(spec, workspace, _config_key(spec.model))


@lru_cache(maxsize=8)  # a stream holds ~10^4-10^5 events: a handful of micro-batches' worth
def _stream_cached(spec: TrainingSpec, workspace: int, config_key: str
                   ) -> tuple[list[tuple], list[tuple[int, str, int]]]:
    _, priced, st = setup(spec, workspace)
    marks: list[tuple[int, str, int]] = []
    return build_events(priced, spec, st, marks=marks), marks


def _measure(spec: TrainingSpec, workspace: int = CUBLAS_WORKSPACE_BYTES) -> tuple[int, list[tuple]]:
    """(closed-form allocated peak, event stream) of `spec`, for `reserved.envelope`."""
    _, priced, st = setup(spec, workspace)
    points = walk([p.step for p in priced], st)
    return peak(points).allocated, stream(spec, workspace)[0]


def shape_stream(spec: TrainingSpec, workspace: int = CUBLAS_WORKSPACE_BYTES
                 ) -> tuple[int, list[tuple], list[tuple[int, str, int]]]:
    """(closed-form allocated peak, alloc/free stream of two iterations, its phase marks as
    (event index, phase, iteration)): what `hybridmem.batches.run` composes per batch shape.
    The stream is the cached one (`stream`): callers read it, never change it."""
    spec = as_job(spec)  # the tier's Python entry: a Job as it is
    _, priced, st = setup(spec, workspace)
    events, marks = stream(spec, workspace)
    return peak(walk([p.step for p in priced], st)).allocated, events, marks


@lru_cache(maxsize=None)
def _measure_with(workspace: int) -> Callable[[TrainingSpec], tuple[int, list[tuple]]]:
    """`_measure` for one workspace size, the same function object each time, so that
    `reserved.envelope`'s cache (keyed by it) serves every micro-batch probe."""
    if workspace == CUBLAS_WORKSPACE_BYTES:
        return _measure
    return lambda spec: _measure(spec, workspace)


def estimate(spec: TrainingSpec, *, gpu: GPU | None = None,
             capacity: int | str | None = FROM_GPU) -> Prediction:
    """Predict the per-GPU peak memory of `spec` in closed form; `gpu` sets the cuBLAS
    workspace (PyTorch's size for its compute capability; Hopper's when None) and, unless
    `capacity` says otherwise (bytes, or None: unlimited), the allocator's capacity the stream
    is replayed within (`reserved.bounded`): at a GPU's limit the allocator releases its cache
    instead of reserving more, so whether a job fits depends on it."""
    spec = as_job(spec)  # the tier's Python entry: a Job as it is (families.defaults)
    ws = cublas_workspace(gpu)
    limit = gpu_capacity(gpu, capacity)
    graph, priced, points = timeline(spec, ws)
    top = peak(points)
    allocated = top.allocated
    # reserved - allocated from replaying an approximate alloc/free stream through the
    # allocator simulator (`events.py`, `reserved.py`), non-decreasing in the micro-batch
    fit = bounded(spec, allocated, _measure_with(ws), limit)
    if fit.retries and not fit.oom:  # the allocator's behaviour at the limit lowers reserved
        free = allocated + bounded(spec, allocated, _measure_with(ws)).fragmentation
        if free > allocated + fit.fragmentation:
            fit = dataclasses.replace(fit, uncapped=free)
    waste = fit.fragmentation
    # the former estimate: 2 MiB rounding of the > 10 MiB tensors alive (a lower bound)
    lower = max(p.allocated + p.waste for p in points) - allocated
    reserved = allocated + waste
    breakdown = empty_breakdown()
    breakdown.update(top.bytes)
    breakdown["fragmentation"] = waste
    # paged optimizer state: unified memory outside the allocator, resident on the device
    # until the driver pages it out (job.optimizers.Bnb; Prediction.paged_bytes)
    paged = sum(p.states.paged for p in priced)
    breakdown["context"] = CUDA_CONTEXT_DEFAULT + paged
    modules = _modules(graph, priced)
    st = setup(spec, ws)[2] if not objective_plugins.lm_loss(spec) else None
    ref_line = objectives.reference_module(priced, spec) if st else None
    modules += (ref_line,) if ref_line is not None else ()
    gen_line = objectives.generation_module(spec)  # GRPO's generated ids
    modules += (gen_line,) if gen_line is not None else ()
    # vLLM colocated: a stated fraction of the GPU's memory (objectives.rules.vllm_bytes)
    vllm = objective_rules.vllm_bytes(spec, gpu.memory_bytes if gpu is not None else None)
    breakdown["context"] += vllm
    phases = {}
    for p in points:
        key = f"{p.phase}@{p.iteration}"
        phases[key] = max(phases.get(key, 0), p.allocated)
    return Prediction(
        model=graph.model, method="analytic",
        params_total=sum(m.params for m in modules if m.name != "reference"),
        params_trainable=sum(m.trainable_params for m in modules),
        peak=Peak(allocated_bytes=allocated, reserved_bytes=reserved,
                  device_bytes=reserved + CUDA_CONTEXT_DEFAULT + paged + vllm,
                  phase=top.phase,
                  iteration=top.iteration),
        breakdown=breakdown, modules=modules, paged_bytes=paged,
        notes=_notes(graph, spec, gpu, ws) + paged_notes(paged) + offloaded.notes(priced, spec)
        + techniques.notes(spec)  # packing's (techniques.packing)
        + ((objective_plugins.note(spec),) if not objective_plugins.lm_loss(spec) else ())
        + ((objective_rules.VLLM_WITHOUT_GPU,)
           if spec.vllm_gpu_memory_utilization and gpu is None else ())
        + tuple(
            capacity_notes(fit, allocated, capacity_source(gpu) if capacity == FROM_GPU
                           else "as given")),
        extras={"analytic": {
            "tensor_peak_bytes": max(p.allocated - p.bytes["workspace"] for p in points),
            "fragmentation_lower_bound": lower,
            "phase_peaks": phases, "image_tokens": graph.image_tokens,
            "vision_crops": graph.vision_batch},
            # the last optimizer point without its step temporaries: weights, grads, state
            # and what the loop holds right after `optimizer.step()` (timeline.walk)
            "after_step_allocated_bytes": after_step(points),
            **allocator_extras(fit),
            **({"objective": objective_plugins.summary(
                spec, (ref_line.param + objectives.held_bytes(spec)[0]
                       + (st.ref_forward if top.phase == "forward"
                          and top.bytes["temporary"] == st.ref_forward else 0))
                if ref_line is not None else 0, objectives.held_bytes(spec)[1],
                max((p.allocated for p in points if p.phase == "generation"), default=0),
                vllm)} if st is not None else {})})


def after_step(points) -> int:
    """Allocated bytes right after the last `optimizer.step()` of the timeline."""
    last = [p for p in points if p.phase == "optimizer"][-1]
    return last.allocated - last.bytes["temporary"]
