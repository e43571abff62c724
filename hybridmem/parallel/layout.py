"""The rules of a model-parallel layout (tp, sequence parallel, cp, pp, ep over dp), torch-free.

Why a module of its own: the checks against the model (does `tp` divide the heads?) and the
shapes one rank holds are the same rules for the analytic per-rank pricing
(`hybridmem.parallel.ranks`), the layout advice (`hybridmem.parallel.layouts`) and the config
readers; each is written once here, with its source:

- tensor parallelism shards the attention heads, the KV heads (Megatron-LM asserts
  `num_query_groups % tensor_model_parallel_size == 0`, megatron/training/arguments.py), the
  MLP's intermediate size (ColumnParallelLinear on gate/up, RowParallelLinear on down) and the
  vocabulary (VocabParallelEmbedding, a column-parallel output layer with the vocab-parallel
  cross entropy; torchtitan `parallelize_llama.apply_tp`: `tok_embeddings` RowwiseParallel,
  `output` ColwiseParallel with loss parallel). DTensor shards an uneven dim in ceil-sized
  chunks, so the vocabulary need not divide (rank 0 holds `ceil(vocab / tp)` rows);
- context parallelism splits the sequence: torch's load balancer for causal attention cuts it
  into `2 x cp` chunks (`_context_parallel/_load_balancer.py`, `_HeadTailLoadBalancer`), so
  `seq_len` must divide by `2 x cp`; with sequence parallelism the rank's tokens also split
  over `tp`;
- pipeline parallelism puts `layers / (pp x v)` consecutive layers on each stage (an uneven
  split gives the first stages one more, `stage_sizes`), the token embedding on the first
  stage and the final norm, `lm_head` and loss on the last (torchtitan `pipeline_module_split`,
  Megatron `get_num_layers_to_build`);
- expert parallelism puts `experts / ep` experts on each rank (torchtitan `ExpertParallel`,
  Megatron `num_moe_experts % expert_model_parallel_size == 0`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridmem.errors import SpecError
from hybridmem.job.parallel import INTERLEAVED, ParallelSpec


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dims of a decoder LLM a layout must divide (from its HF config)."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    layers: int
    vocab: int
    experts: int = 0
    expert_ffn: int = 0


def model_shape(data: dict) -> ModelShape:
    """The dims of an HF decoder config dict (`text_config` for a VLM's language model is not
    split: model parallelism is priced for decoder LLMs only)."""
    if "text_config" in data or "vision_config" in data:
        raise SpecError("model", data.get("model_type"),
                        reason="model parallelism (tp/cp/pp/ep) is priced for decoder LLMs, "
                        "not multimodal models")
    heads = int(data["num_attention_heads"])
    hidden = int(data["hidden_size"])
    experts = int(data.get("num_local_experts") or data.get("num_experts") or 0)
    ffn = int(data.get("intermediate_size") or 0)
    return ModelShape(
        heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads), hidden=hidden,
        ffn=ffn, layers=int(data["num_hidden_layers"]), vocab=int(data["vocab_size"]),
        experts=experts, expert_ffn=int(data.get("moe_intermediate_size") or ffn) if experts else 0)


def check_layout(ps: ParallelSpec, shape: ModelShape, seq_len: int) -> None:
    """One-line SpecError for a layout the model's dims do not divide."""
    tp, chunks = ps.tp, ps.pp * ps.pp_virtual_stages
    for field, dim, what in (("tp", shape.heads, "attention heads"),
                             ("tp", shape.kv_heads, "KV heads"),
                             ("tp", shape.ffn, "MLP intermediate size"),
                             ("tp", shape.expert_ffn, "experts' intermediate size")):
        if tp > 1 and dim and dim % tp:
            raise SpecError(f"parallel.{field}", tp, reason=f"does not divide the {dim} {what}")
    if chunks > shape.layers:
        # torchtitan `generate_llm_fqn_per_model_part`: "Number of stages cannot be greater
        # than effective layers"; an uneven split is not an error (`stage_sizes`)
        raise SpecError("parallel.pp", ps.pp, reason=f"pp x pp_virtual_stages = {chunks} "
                        f"stages for the {shape.layers} layers: a stage would be empty")
    if ps.ep > 1 and not shape.experts:
        raise SpecError("parallel.ep", ps.ep, reason="the model has no experts (dense model)")
    if ps.ep > 1 and shape.experts % ps.ep:
        raise SpecError("parallel.ep", ps.ep, reason=f"does not divide the {shape.experts} experts")
    if ps.cp > 1 and seq_len % (2 * ps.cp):
        raise SpecError("seq_len", seq_len, reason=f"context parallelism cuts it into 2 x cp = "
                        f"{2 * ps.cp} chunks (causal load balancing); not divisible")
    if ps.sequence_parallel and (seq_len // ps.cp) % tp:
        raise SpecError("seq_len", seq_len, reason=f"sequence parallelism splits each rank's "
                        f"{seq_len // ps.cp} tokens over tp={tp}; not divisible")


def rank_config(data: dict, tp: int, ep: int) -> dict:
    """The HF config of the model one tensor/expert-parallel rank holds: heads, KV heads,
    intermediate sizes and vocabulary divided by `tp`, experts by `ep`, the head dim kept
    (a rank's linears are the full model's column/row shards). Layers are not cut here: the
    stage's layers are chosen from the priced graph (`stage_layers`)."""
    shape = model_shape(data)
    out = dict(data)
    out["_source"] = f"one rank's shard (tp={tp}, ep={ep}) of {data.get('_source', 'a model')}"
    out["head_dim"] = shape.head_dim
    out["num_attention_heads"] = shape.heads // tp
    out["num_key_value_heads"] = shape.kv_heads // tp
    if shape.ffn:
        out["intermediate_size"] = shape.ffn // tp
    if "moe_intermediate_size" in data:
        out["moe_intermediate_size"] = shape.expert_ffn // tp
    out["vocab_size"] = math.ceil(shape.vocab / tp)
    for key in ("num_local_experts", "num_experts"):
        if data.get(key):
            out[key] = shape.experts // ep
            # a rank routes each token to its top-k of all experts; with fewer local experts
            # than k the graph still prices k routed rows per token (the tokens others send)
    return out


def stage_sizes(layers: int, stages: int) -> list[int]:
    """Decoder layers of each of `stages` pipeline stages, in stage order.

    An even split where `stages` divides the layers. Otherwise torchtitan's rule
    (`torchtitan/distributed/pipeline_parallel.py::generate_llm_fqn_per_model_part`:
    `layers_per_stage = n // stages`, the `n % stages` extra layers to the first stages, one
    each), with its `pipeline_parallel_first_stage_less_layers` and `..._last_stage_less_layers`
    at 0 (the job has no field for them: the embedding and the head count as no layer);
    transformers' pipeline split (`distributed/pipeline_parallel.py::layer_range_for_rank`) is
    the same rule. Megatron-LM refuses an uneven split unless its first and last stages are
    sized explicitly (`--decoder-first-pipeline-num-layers` / `--decoder-last-...`,
    `num_layers % pipeline_model_parallel_size` asserted otherwise), which the job cannot
    express; priced here as torchtitan splits it, every rank priced, so the answer is the rank
    whose larger stage (with its in-flight micro-batches) peaks highest."""
    per, extra = divmod(layers, stages)
    return [per + (s < extra) for s in range(stages)]


def stage_layers(ps: ParallelSpec, layers: int, rank: int) -> list[int]:
    """Decoder layer indices on pipeline rank `rank`: its `v` chunks of consecutive layers
    (`stage_sizes`), chunk c being stage `rank + c x pp` (torchtitan / torch pipelining's
    loop style, `generate_stage_to_rank_mapping` style "loop")."""
    sizes = stage_sizes(layers, ps.pp * ps.pp_virtual_stages)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    return [i for c in range(ps.pp_virtual_stages)
            for i in range(starts[rank + c * ps.pp], starts[rank + c * ps.pp] + sizes[rank + c * ps.pp])]


def in_flight(ps: ParallelSpec, rank: int) -> float:
    """Micro-batches whose stage activations rank `rank` holds at once, in units of the rank's
    whole layer set (its v chunks together) for one micro-batch.

    - gpipe (ScheduleGPipe): every forward before any backward: m.
    - 1f1b (Schedule1F1B._step_microbatches: `warmup_chunks = min(n_microbatches, num_stages -
      stage_index)`, then one forward and one backward alternate): min(m, pp - rank).
    - interleaved-1f1b (ScheduleInterleaved1F1B, `_get_warmup_ops(..., multiply_factor=2)`:
      `(v - 1) x microbatches_per_round + 2 (pp - 1 - rank)` warm-up chunk forwards, capped at
      m x v): warm-up + 1 chunk forwards, each a 1/v share of the rank's layers. Megatron's
      penalty `1 + (pp - 1) / (pp v)` on pp micro-batches is its rank-0 value.
    - zero-bubble (ScheduleInterleavedZeroBubble): the most chunk forwards alive at once in
      its action order (`zero_bubble_order`), a chunk's alive from its forward "F" to its
      weight step "W", not to its input-gradient step "I" (`stage_backward_input` runs
      `autograd.grad(..., retain_graph=True)`; torch/distributed/pipelining/_backward.py).
    """
    m, pp, v = ps.microbatches, ps.pp, ps.pp_virtual_stages
    if pp == 1:
        return 1.0
    if ps.pp_schedule == "gpipe":
        return float(m)
    if ps.pp_schedule not in INTERLEAVED:
        return float(min(m, pp - rank))
    if ps.pp_schedule == "zero-bubble":
        alive, most = set(), 0
        for kind, c, b in zero_bubble_order(ps, rank):
            if kind == "F":
                alive.add((c, b))
                most = max(most, len(alive))
            elif kind == "W":
                alive.discard((c, b))
        return most / v
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    return min(warmup + 1, m * v) / v


def zero_bubble_order(ps: ParallelSpec, rank: int) -> list[tuple[str, int, int]]:
    """Pipeline rank `rank`'s actions under zero bubble, in order: ("F" forward, "I" input
    gradient, "W" weight gradient; local chunk c, i.e. stage `rank + c x pp`; micro-batch).

    torch 2.13 `ScheduleInterleavedZeroBubble._calculate_single_rank_operations` ->
    `_get_1f1b_rank_ops(..., enable_zero_bubble=True)` (torch/distributed/pipelining/
    schedules.py), without its no-op slots: `_get_warmup_ops(multiply_factor=1)` forwards;
    then, per remaining op, a forward and an input-gradient step, and, once `rank` of them
    have run (`num_1f1b_microbatches = rank`), the weight step of the oldest input-gradient
    step still owed; the cool-down's input-gradient steps likewise; the weight steps still owed
    last. A forward's chunk advances every `microbatches_per_round` ops, a backward's runs the
    chunks in reverse (`forward_stage_index` / `backward_stage_index`).
    """
    m, pp, v = ps.microbatches, ps.pp, ps.pp_virtual_stages
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (pp - 1 - rank), m * v)
    total = m * v
    fwd_chunk = lambda op: (op // per_round) % v  # noqa: E731
    bwd_chunk = lambda op: v - 1 - ((op - warmup) // per_round) % v  # noqa: E731
    nxt = {"F": [0] * v, "I": [0] * v, "W": [0] * v}
    out: list[tuple[str, int, int]] = []
    owed: list[int] = []

    def emit(kind: str, chunk: int) -> None:
        out.append((kind, chunk, nxt[kind][chunk]))
        nxt[kind][chunk] += 1

    for op in range(total + warmup):  # warm-up, then `total - warmup` 1F1B ops, `warmup` cool-down
        if op < total:
            emit("F", fwd_chunk(op))
        if op >= warmup:
            emit("I", bwd_chunk(op))
            owed.append(bwd_chunk(op))
            if op - warmup >= rank:
                emit("W", owed.pop(0))
    while owed:
        emit("W", owed.pop(0))
    return out
