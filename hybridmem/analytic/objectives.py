"""The analytic tier's terms for the objectives beyond SFT, read from the plug-ins' traits
(`hybridmem.objectives`: `rows`, `SCORE_HEAD`, `GENERATES`, `BATCH_COLUMNS`, ...).

What changes against the SFT step, as each objective's `step.py` runs it: the policy's graph
has `objectives.rows` sequences (chosen + rejected concatenated); its head is the trainer's loss
(`families.common.objective_acts`); the reward model's head is a (1, hidden) `score`; a
separate reference adds a frozen copy of the model's weights (`Statics.param`, its own module
line) and every reference forward its no-grad high point at the end of the policy's forward
(`Statics.ref_forward`, the trainer computes the reference log-probs then, with the policy's
graph alive); KTO's reference runs its KL batch and its completions there (the policy's own
KL forward, under no_grad before its graph exists, stays below both). GRPO's generation phase
(KV cache, sampling, the reference's log-probs) is `Statics.generation`, once per step before
its first micro-step; its outputs stay alive through the step (`generation_held`).
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.analytic.events import no_grad_working_set
from hybridmem.families.common.activations import FP32, Ctx
from hybridmem.families.common.objective_acts import reference_head, trl_reference_head
from hybridmem import objectives as plugins
from hybridmem.objectives.grpo import completion_length, old_logps
from hybridmem.allocator.alloc import t
from hybridmem.models.graph import Layer, Module, ModelGraph, ParamTensor

def padded_sdpa_mask(layer: Layer, c: Ctx, acts):
    """A decoder layer's SDPA under TRL's collator, whose batch carries an attention mask (a
    batch of varied lengths is padded to its longest: `hybridmem.objectives.sft.step
    .sft_trl_batch`, the objective's `PADDED`): masking_utils' boolean (b, 1, s, s) mask
    reaches each layer's `scaled_dot_product_attention`, which converts it to the query's dtype
    (aten/src/ATen/native/transformers/attention.cpp `convert_boolean_attn_mask`) and saves
    that float mask for backward: one (b x s x s, e) tensor per layer."""
    d = layer.dims
    mask = t(d["b"] * d["s"] * d["s"], c.e)
    return replace(acts, saved=acts.saved + mask, parts=(*acts.parts, mask))


def graph_spec(spec):
    """The spec whose graph the policy runs: `objectives.rows` sequences per forward."""
    rows = plugins.rows(spec)
    return spec if rows == spec.micro_batch else spec.with_(micro_batch=rows)


def with_score_head(graph: ModelGraph, spec) -> ModelGraph:
    """The reward model's graph: the lm_head replaced by `score`, Linear(hidden, 1, bias=False)
    (transformers `LlamaForSequenceClassification`; no tying: it has no output embedding)."""
    if not plugins.of(spec).SCORE_HEAD:
        return graph
    head = graph.module("lm_head")
    old = head.layers[0]
    layer = Layer(name="score", kind="lm_head", params=(ParamTensor("weight", (1, old.dims["h"])),),
                  trainable=old.trainable, on_grad_path=old.on_grad_path,
                  dims=dict(old.dims, vocab=1, tied=False))
    modules = tuple(Module(name=m.name, prefix="score", layers=(layer,)) if m.name == "lm_head"
                    else m for m in graph.modules)
    return replace(graph, modules=modules, tied_embeddings=False)


def reference_param_bytes(priced, spec) -> int:
    """A separate reference: `create_reference_model`'s deep copy of the model's weights and
    buffers in their dtype (a full or projector run has no adapters to leave out)."""
    if plugins.ref_model_of(spec) != "separate":
        return 0
    return sum(p.states.param for p in priced)


def reference_forward(priced, spec, c: Ctx) -> int:
    """The reference forward's high point under no_grad (separate copy or disabled adapters)
    at the end of the policy's forward: the residual stream and one decoder layer's no-grad
    working set, or the head's (`objective_acts.reference_head`); 0 without a reference
    forward there (GRPO's runs in its generation phase: `generation`)."""
    if plugins.ref_model_of(spec) in ("none", "precomputed") or plugins.of(spec).GENERATES:
        return 0
    if c.head is not None:  # a technique's fused loss runs the reference's head in its chunks
        return _no_grad_forward(priced, c, None, lambda d: 0)
    if c.trl_head:  # TRL's fused head (`objectives.fused_head`)
        return _no_grad_forward(priced, c, None, lambda d: trl_reference_head(
            d["b"], d["s"], d["h"], d["vocab"], c))
    return _no_grad_forward(priced, c, None, lambda d: reference_head(
        d["b"], d["s"], d["h"], d["vocab"], c, plugins.prompt_length(spec), spec.objective))


def _no_grad_forward(priced, c: Ctx, shape: tuple[int, int] | None, head) -> int:
    """High point of a forward under no_grad over `shape` = (rows, tokens) (None: the policy's
    own): the largest decoder layer's working set beside the residual stream, or the stream
    at the head plus `head(dims)`."""
    best = 0
    for p in priced:
        d = p.layer.dims
        b, s = shape or (d.get("b", 0), d.get("s", 0))
        if p.layer.kind == "decoder_layer" and not d.get("moe"):
            best = max(best, _layer_no_grad(d, c, b, s))
        elif p.layer.kind == "decoder_layer":  # the policy's shape's acts: an approximation
            stream = t(b * s * d["h"], c.stream)
            best = max(best, stream + sum(no_grad_working_set(p.layer, p.step.acts, c.amp)))
        elif p.layer.kind == "lm_head":
            best = max(best, t(b * s * d["h"], c.stream) + head(dict(d, b=b, s=s)))
    return best


def _layer_no_grad(d: dict, c: Ctx, b: int, s: int) -> int:
    """A decoder layer (not the first) under no_grad over b x s tokens, modeling_llama.py:
    four stream tensors stay alive (LlamaModel's `inputs_embeds`, the layer's input its caller
    holds, the residual, the norm's output) with RoPE's cos / sin tables; the gated MLP adds
    act(gate), up and their product (e; under autocast the frozen weight's cast in use, not
    cached: no grad), the attention at k's rotated sum q, v, q_embed, k, k * cos,
    rotate_half(k) * sin and k_embed."""
    tokens = b * s
    base = 4 * t(tokens * d["h"], c.stream) + 2 * t(s * d["head_dim"], c.stream)
    cast = t(d["ffn"] * d["h"], 2) if c.amp else 0
    mlp = 3 * t(tokens * d["ffn"], c.e) + cast
    q = t(tokens * d["heads"] * d["head_dim"], c.e)
    kv = t(tokens * d["kv_heads"] * d["head_dim"], c.e)
    return base + max(mlp, 2 * q + 5 * kv)


def generation(priced, spec, c: Ctx) -> dict:
    """GRPO's generation phase (`objectives.grpo.step.grpo_prepare`), the `Statics` fields
    `generation` and `generation_held`; empty for the other objectives.

    It runs in `_prepare_inputs`, outside the loss's autocast: the weights' dtype (g bytes).
    G = micro_batch x grad_accum sequences of P prompt + C completion tokens, L layers.
    - Prefill: every layer's K and V of P tokens (DynamicCache) beside one layer's no-grad
      working set over G x P tokens, the prompt ids.
    - Last decode step (the cache only grows): K and V of P + C - 1 tokens in every layer,
      and at once the larger of a layer's old K beside the one `torch.cat` makes
      (cache_utils.py `DynamicLayer.update`), the sampled logits (G x V in g, their fp32 copy;
      then softmax's probs and the exponential draw of `multinomial`: G x V fp32 each,
      generation/utils.py `_sample`), the ids' last `cat`; the ids of P + C - 1 tokens.
    - The reference's log-probs (beta > 0), no_grad, micro_batch rows at a time over P + C
      tokens with `logits_to_keep = C + 1`: a layer's working set, or the kept logits, their
      `/ temperature` copy and one row's log_softmax; the ids and advantages alive.
    Held until the step ends: the ids (G x (P + C) int64), the advantages (G fp32), the
    reference's log-probs (G x C fp32)."""
    if not plugins.of(spec).GENERATES:
        return {}
    g = c.param
    gc = replace(c, e=g, stream=g, amp=False, autocast=False)
    n, G = spec.micro_batch, spec.micro_batch * spec.grad_accum
    C = completion_length(spec)
    P = spec.seq_len - C
    layers = [p.layer.dims for p in priced if p.layer.kind == "decoder_layer"]
    V = next(p.layer.dims["vocab"] for p in priced if p.layer.kind == "lm_head")
    d0 = layers[0]

    def kv(tokens: int) -> int:  # one K (or V) of one layer
        return t(G * tokens * d0["kv_heads"] * d0["head_dim"], g)

    def cache(tokens: int) -> int:
        return 2 * len(layers) * kv(tokens)

    layer_ws = max(_layer_no_grad(d, gc, G, P) for d in layers) if not d0.get("moe") else 0
    prefill = cache(P) + layer_ws + t(G * P, 8)
    sampling = max(t(G * V, g) + t(G * V, FP32), 2 * t(G * V, FP32))
    decode = cache(P + C - 1) + t(G * (P + C - 1), 8) + max(
        kv(P + C - 2), sampling, t(G * (P + C), 8))
    ids, advantages = t(G * (P + C), 8), t(G, FP32)
    peak = max(prefill, decode)
    if c.trl_head:  # trl >= 1.15: the buffer's ids and masks (`_grpo_fused_prepare`)
        return _fused_generation(priced, spec, c, peak)
    held = ids + advantages
    if plugins.ref_model_of(spec) != "none":
        logps = t(G * C, FP32)
        row = 0 if g == FP32 else t(C * V, g)

        def head(d):  # the kept logits and their copy, then the copy and a row's log_softmax
            return max(t(n * (C + 1) * V, g) + t(n * C * V, g), t(n * C * V, g) + row)

        peak = max(peak, held + logps + _no_grad_forward(priced, gc, (n, P + C), head))
        held += logps
    return {"generation": peak, "generation_held": held}


def _fused_generation(priced, spec, c: Ctx, sampling: int) -> dict:
    """GRPO's generation phase at a TRL with the fused head (trl 1.16
    `_generate_and_score_completions`, `objectives.grpo.step._grpo_fused_prepare`) after the
    sampling loop's high point `sampling`: the buffer's prompt and completion ids and masks
    (4 x G x tokens int64 over P + C), the (P + C) concatenations of ids and masks for the
    no_grad forwards, then the old policy's log-probs (num_iterations > 1) and the
    reference's (beta > 0), each a fused forward of micro_batch rows (`trl_reference_head`)
    under the loss's autocast (`c`: GRPOTrainer's `accelerator.autocast()`) whose (G x C)
    fp32 result is kept; the advantages (G fp32)."""
    n, G, S = spec.micro_batch, spec.micro_batch * spec.grad_accum, spec.seq_len
    C = completion_length(spec)
    buffer = 2 * t(G * (S - C), 8) + 2 * t(G * C, 8)
    held, peak = buffer, sampling
    forwards = int(old_logps(spec)) + int(plugins.ref_model_of(spec) != "none")
    if forwards:
        concat = 2 * t(G * S, 8)
        step = _no_grad_forward(priced, c, (n, S), lambda d: trl_reference_head(
            d["b"], d["s"], d["h"], d["vocab"], c))
        for _ in range(forwards):
            # each forward's per-token outputs (n x (S - 1) fp32 log-probs and entropy) and
            # its kept slice's `cat` (G x C fp32)
            peak = max(peak, held + concat + step + 2 * t(n * (S - 1), FP32))
            held += t(G * C, FP32)
    held += t(G, FP32)
    return {"generation": peak, "generation_held": held}


def generation_module(spec):
    """The `generation` line of `Prediction.modules` for GRPO (None otherwise). As the trace
    tier's line it holds no activation: the generated ids are the step's inputs; their bytes
    and the reference's log-probs are `extras["objective"]` (`held_bytes`)."""
    from hybridmem.prediction import ModuleMemory

    if not plugins.of(spec).GENERATES:
        return None
    return ModuleMemory(name="generation", params=0, trainable_params=0, param=0, grad=0,
                        optimizer=0, activation=0)


def held_bytes(spec) -> tuple[int, int]:
    """(reference, generation) bytes GRPO's generation phase leaves alive through the step:
    the reference's log-probs (G x C fp32), the generated ids (G x (P + C) int64)."""
    if not plugins.of(spec).GENERATES:
        return 0, 0
    from hybridmem.environment import installed

    G, C = spec.micro_batch * spec.grad_accum, completion_length(spec)
    ref = t(G * C, FP32) if plugins.ref_model_of(spec) != "none" else 0
    if not plugins.fused_head(spec, installed("trl")):
        return ref, t(G * spec.seq_len, 8)
    # trl >= 1.15 (`_fused_generation`): the prompt and completion ids and masks, the old
    # policy's log-probs at num_iterations > 1
    old = t(G * C, FP32) if old_logps(spec) else 0
    return ref, 2 * t(G * (spec.seq_len - C), 8) + 2 * t(G * C, 8) + old


def batch_bytes(spec) -> int:
    """The objective's collated batch against the SFT one's ids + labels over the same rows
    (its `step.batch`): `BATCH_COLUMNS` more (rows x seq) int64 columns (ORPO's attention
    mask, KTO's KL ids and labels; GRPO's stand-in has one fewer), the generation's outputs
    (`generation_held`), and `PRECOMPUTED_COLUMNS` fp32 per sequence of precomputed reference
    log-probs."""
    objective = plugins.of(spec)
    out = objective.BATCH_COLUMNS * t(plugins.rows(spec) * spec.seq_len, 8)
    if objective.GENERATES:
        out += generation_held(spec)
    if plugins.ref_model_of(spec) == "precomputed":
        out += objective.PRECOMPUTED_COLUMNS * t(spec.micro_batch, 4)
    return out


def generation_held(spec) -> int:
    """GRPO: the generation phase's outputs alive until the step ends (`generation`)."""
    return sum(held_bytes(spec)) + t(spec.micro_batch * spec.grad_accum, FP32)  # advantages


def reference_module(priced, spec):
    """The `reference` line of `Prediction.modules` (None without a reference): the copy's
    parameters; its forward's high point is a temporary (`extras["objective"]`)."""
    from hybridmem.prediction import ModuleMemory

    if plugins.ref_model_of(spec) in ("none", "precomputed"):
        return None
    separate = plugins.ref_model_of(spec) == "separate"
    return ModuleMemory(name="reference",
                        params=sum(p.states.param_count for p in priced) if separate else 0,
                        trainable_params=0, param=reference_param_bytes(priced, spec),
                        grad=0, optimizer=0, activation=0)
