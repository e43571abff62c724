"""The analytic tier's terms for the objectives beyond SFT (`hybridmem.job.objective`).

What changes against the SFT step, as `hybridmem.trace.objectives` runs it: the policy's graph
has `objective.rows` sequences (chosen + rejected concatenated); its head is the trainer's loss
(`families.decoders.objective_acts`); the reward model's head is a (1, hidden) `score`; a
separate reference adds a frozen copy of the model's weights (`Statics.param`, its own module
line) and every reference forward its no-grad high point at the end of the policy's forward
(`Statics.ref_forward`, the trainer computes the reference log-probs then, with the policy's
graph alive). GRPO and KTO are priced by the trace tier (`scope.refusal`).
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.analytic.events import _no_grad_working_set
from hybridmem.families.common.activations import Ctx
from hybridmem.families.decoders.objective_acts import reference_head
from hybridmem.job import objective as rules
from hybridmem.allocator.alloc import t
from hybridmem.models.graph import Layer, Module, ModelGraph, ParamTensor

PRICED: tuple[str, ...] = ("sft", "dpo", "orpo", "rm")
"""Objectives with closed forms here (the others: the trace tier)."""


def graph_spec(spec):
    """The spec whose graph the policy runs: `objective.rows` sequences per forward."""
    rows = rules.rows(spec)
    return spec if rows == spec.micro_batch else spec.with_(micro_batch=rows)


def with_score_head(graph: ModelGraph, spec) -> ModelGraph:
    """The reward model's graph: the lm_head replaced by `score`, Linear(hidden, 1, bias=False)
    (transformers `LlamaForSequenceClassification`; no tying: it has no output embedding)."""
    if spec.objective != "rm":
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
    if rules.ref_model_of(spec) != "separate":
        return 0
    return sum(p.states.param for p in priced)


def reference_forward(priced, spec, c: Ctx) -> int:
    """The reference forward's high point under no_grad (separate copy or disabled adapters):
    the residual stream and one decoder layer's no-grad working set, or the head's
    (`objective_acts.reference_head`); 0 without a reference forward in the step."""
    if rules.ref_model_of(spec) in ("none", "precomputed"):
        return 0
    best = 0
    for p in priced:
        d = p.layer.dims
        if p.layer.kind == "decoder_layer" and not d.get("moe"):
            # a decoder layer (not the first) under no_grad, modeling_llama.py: four stream
            # tensors stay alive (LlamaModel's `inputs_embeds`, the layer's input its caller
            # holds, the residual, the norm's output) with RoPE's cos / sin tables; the gated
            # MLP adds act(gate), up and their product (e; under autocast the frozen weight's
            # cast in use, not cached: no grad), the attention at k's rotated sum q, v,
            # q_embed, k, k * cos, rotate_half(k) * sin and k_embed
            tokens = d["b"] * d["s"]
            base = 4 * t(tokens * d["h"], c.stream) + 2 * t(d["s"] * d["head_dim"], c.stream)
            cast = t(d["ffn"] * d["h"], 2) if c.amp else 0
            mlp = 3 * t(tokens * d["ffn"], c.e) + cast
            q = t(tokens * d["heads"] * d["head_dim"], c.e)
            kv = t(tokens * d["kv_heads"] * d["head_dim"], c.e)
            best = max(best, base + max(mlp, 2 * q + 5 * kv))
        elif p.layer.kind == "decoder_layer":
            stream = t(d["b"] * d["s"] * d["h"], c.stream)
            best = max(best, stream + sum(_no_grad_working_set(p.layer, p.step.acts, c.amp)))
        elif p.layer.kind == "lm_head":
            best = max(best, t(d["b"] * d["s"] * d["h"], c.stream)
                       + reference_head(d["b"], d["s"], d["h"], d["vocab"], c,
                                        rules.prompt_length(spec), spec.objective))
    return best


def batch_bytes(spec) -> int:
    """The objective's collated batch against the SFT one's ids + labels over the same rows
    (`trace.objectives.batch`): DPO's loss mask and ORPO's labels take the labels' place, the
    reward model has ids only; precomputed reference log-probs are fp32 per sequence."""
    out = -t(rules.rows(spec) * spec.seq_len, 8) if spec.objective == "rm" else 0
    if rules.ref_model_of(spec) == "precomputed":
        out += 2 * t(spec.micro_batch, 4)
    return out


def reference_module(priced, spec):
    """The `reference` line of `Prediction.modules` (None without a reference): the copy's
    parameters; its forward's high point is a temporary (`extras["objective"]`)."""
    from hybridmem.prediction import ModuleMemory

    if rules.ref_model_of(spec) in ("none", "precomputed"):
        return None
    separate = rules.ref_model_of(spec) == "separate"
    return ModuleMemory(name="reference",
                        params=sum(p.states.param_count for p in priced) if separate else 0,
                        trainable_params=0, param=reference_param_bytes(priced, spec),
                        grad=0, optimizer=0, activation=0)
