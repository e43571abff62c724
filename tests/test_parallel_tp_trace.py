"""Tensor parallelism against a real CPU run of `parallelize_module` under torch's fake process
group (`torch.testing._internal.distributed.fake_pg`), one rank at a time.

The oracle: tiny Llama (4 heads, 2 KV heads, ffn 128, vocab 128) with torchtitan's plan
(q/k/v and gate/up `ColwiseParallel`, o and down `RowwiseParallel`, the embedding
`RowwiseParallel`, `lm_head` `ColwiseParallel`) at tp=2, fp32, eager attention, 2 x 32
tokens. Counted from the tensors themselves (each DTensor's local shard): params, grads, AdamW
state, and each decoder layer's saved activations (unique storages packed by autograd while the
layer runs, parameters excluded). The same counts for the un-parallelized model of the rank's
shape (`layout.rank_config`: heads, KV heads, ffn, vocab / tp), which is what the analytic
per-rank tier prices, in the same process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec

CHILD = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from transformers import AutoModelForCausalLM
    from hybridmem.models.loader import load_config

    full, narrow, tp, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
    mesh = init_device_mesh("cpu", (tp,))

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def sequence_parallel(m):
        # torchtitan's plan (parallelize_llama.apply_tp): norms SequenceParallel, each block's
        # input all-gathered (PrepareModuleInput -> Replicate), row-parallel outputs Shard(1)
        for layer in m.model.layers:
            parallelize_module(layer, mesh, {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
        parallelize_module(m, mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})

    def run(model, parallel):
        torch.manual_seed(0)
        # sdpa under sp: the local sequence shard builds no mask (is_causal), positions given
        m = AutoModelForCausalLM.from_config(load_config(model), dtype=torch.float32,
                                             attn_implementation="sdpa" if parallel == "sp"
                                             else "eager")
        if parallel == "sp":
            sequence_parallel(m)
        elif parallel:
            for layer in m.model.layers:
                parallelize_module(layer, mesh, {
                    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel()})
            parallelize_module(m, mesh, {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())})
        params = {local(p).untyped_storage().data_ptr() for p in m.parameters()}
        current, seen, saved = [None], set(), {}

        def pack(t):
            if current[0] is not None:
                x = local(t)
                x = x.trigger_wait() if isinstance(x, AsyncCollectiveTensor) else x
                s = x.untyped_storage()
                if s.data_ptr() not in params and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    saved[current[0]] = saved.get(current[0], 0) + s.nbytes()
            return t

        for i, layer in enumerate(m.model.layers):
            layer.register_forward_pre_hook(lambda mod, a, i=i: current.__setitem__(0, i))
            layer.register_forward_hook(lambda mod, a, o: current.__setitem__(0, None))
        ids = torch.randint(0, 60, (2, 32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if parallel == "sp":
                logits = local(m(input_ids=ids,
                                 position_ids=torch.arange(32)[None].expand(2, 32)).logits)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
            else:
                loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        count = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)
        out = {"param": count(m.parameters()),
               "grad": count(p.grad for p in m.parameters() if p.grad is not None),
               "layer_saved": [saved[i] for i in sorted(saved)]}
        # per-parameter AdamW: foreach refuses a mix of DTensor shards and plain norm weights
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
        opt.step()
        out["optimizer"] = count(v for s in opt.state.values() for k, v in s.items() if k != "step")
        return out

    print(json.dumps({"tp": run(full, "tp"), "narrow": run(narrow, None),
                      "sp": run(full, "sp")}))
""")


CHILD_2D = textwrap.dedent('''
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from transformers import AutoModelForCausalLM
from hybridmem.models.loader import load_config

model, dp, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("fake", rank=0, world_size=dp * tp, store=FakeStore())
mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
m = AutoModelForCausalLM.from_config(load_config(model), dtype=torch.float32, attn_implementation="eager")
for layer in m.model.layers:
    parallelize_module(layer, mesh["tp"], {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel()})
parallelize_module(m, mesh["tp"], {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                   "lm_head": ColwiseParallel(output_layouts=Replicate())})
for layer in m.model.layers:
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(m, mesh=mesh["dp"])
def local(t):
    return t.to_local() if hasattr(t, "to_local") else t
def count(ts):
    return sum(local(t).numel() * local(t).element_size() for t in ts)
ids = torch.randint(0, 60, (2, 32))
m(input_ids=ids, labels=ids).loss.backward()
out = {"param": count(m.parameters()), "grad": count(p.grad for p in m.parameters() if p.grad is not None)}
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
opt.step()
out["optimizer"] = count(v for s in opt.state.values() for k, v in s.items() if k != "step")
print(json.dumps(out))
''')
"""FSDP2 x TP on a (dp, tp) mesh: torchtitan's order (TP plan on the "tp" sub-mesh, then
`fully_shard` per layer and on the root over "dp"); rank 0 of dp x tp ranks."""


@pytest.fixture(scope="module")
def measured():
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel.layout import rank_config

    narrow = materialize_config(json.dumps(rank_config(load_config_dict("tiny-llama")[1], 2, 1)))
    proc = subprocess.run([sys.executable, "-c", CHILD, "tiny-llama", narrow, "2", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_tp_rank_saves_what_the_narrow_model_saves(measured):
    """Column/row-parallel layers: the rank's layer is the narrow layer, byte for byte."""
    assert measured["tp"]["layer_saved"] == measured["narrow"]["layer_saved"]
    assert measured["tp"]["param"] == measured["narrow"]["param"]
    assert measured["tp"]["optimizer"] == measured["narrow"]["optimizer"]
    # the embedding's gradient is a Replicate DTensor of the whole vocabulary (64 more rows of
    # 64 fp32 values than the narrow model's 64-row embedding)
    assert measured["tp"]["grad"] == measured["narrow"]["grad"] + 64 * 64 * 4


def test_analytic_per_rank_states_equal_the_real_tp_rank(measured):
    from hybridmem.parallel import ranks

    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=32, precision="fp32",
                        attn="eager", parallel=ParallelSpec(world_size=2, tp=2))
    _, answers = ranks.price_ranks(spec)
    # the optimizer step holds every grad and the state: its breakdown is the states' own
    from hybridmem.analytic.estimate import setup
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel.layout import rank_config, model_shape

    narrow = spec.with_(model=materialize_config(json.dumps(rank_config(
        load_config_dict("tiny-llama")[1], 2, 1))), parallel=ParallelSpec())
    _, priced, _ = setup(narrow)
    layers = [(p.module, p.layer) for p in priced]
    states = ranks._states(spec, layers)
    extra = ranks._embedding_grad(spec, layers, model_shape(load_config_dict("tiny-llama")[1]))
    assert states.param == measured["tp"]["param"]
    assert states.grad + extra == measured["tp"]["grad"]
    assert states.optimizer == measured["tp"]["optimizer"]
    # the analytic tier's narrow layer against the measured one (CPU storages are not rounded
    # to 512 B as CUDA's allocations are; layer 0 also saves the rotary and mask tensors)
    saved = [p.step.acts.saved for p in priced if p.layer.kind == "decoder_layer"]
    for ours, real in zip(saved, measured["tp"]["layer_saved"]):
        assert abs(ours - real) / real < 0.03
    assert answers[0].breakdown["param"] == states.param


def test_fsdp_times_tp_states_equal_the_real_2x2_rank():
    """FSDP 2 x TP 2 (world 4): the rank's local shards of params, grads and AdamW state are
    the narrow (tp) model's FSDP shards over dp, as `ranks._states` prices them, exactly; the
    embedding's gradient is reduce-scattered by FSDP here (no whole-vocabulary copy)."""
    from hybridmem.analytic.estimate import setup
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel import ranks
    from hybridmem.parallel.layout import rank_config

    proc = subprocess.run([sys.executable, "-c", CHILD_2D, "tiny-llama", "2", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=32, precision="fp32",
                        attn="eager", parallel=ParallelSpec(world_size=4, tp=2, strategy="fsdp"))
    narrow = spec.with_(model=materialize_config(json.dumps(rank_config(
        load_config_dict("tiny-llama")[1], 2, 1))), parallel=ParallelSpec())
    layers = [(p.module, p.layer) for p in setup(narrow)[1]]
    states = ranks._states(spec, layers)
    assert (states.param, states.grad, states.optimizer) == (
        real["param"], real["grad"], real["optimizer"])


def test_sequence_parallel_layer_against_the_real_rank(measured):
    """tp=2 with torchtitan's sequence parallelism: a layer saves its 1/tp share plus the two
    all-gathered block inputs (`ranks._gathered_inputs`); analytic within 3 % of the real rank
    (layer 1; layer 0 also holds the rotary tensors)."""
    from hybridmem.analytic import timeline
    from hybridmem.parallel import ranks

    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=32, precision="fp32",
                        attn="sdpa", parallel=ParallelSpec(world_size=2, tp=2,
                                                           sequence_parallel=True))
    seen = []
    real_walk = timeline.walk

    def walk(steps, st, iterations=2):
        seen.append([s.acts.saved for s in steps])
        return real_walk(steps, st, iterations)

    timeline.walk = walk
    try:
        ranks.price_ranks(spec)
    finally:
        timeline.walk = real_walk
    layer_1 = seen[0][3]  # the stage's steps: embedding, rotary, layers.0, layers.1, norm, head
    real = measured["sp"]["layer_saved"][1]
    assert abs(layer_1 - real) / real < 0.03


# --- the trace tier (`parallel.trace_ranks`) against the real runs above ---------------------

LAYOUTS = {"tp": (ParallelSpec(world_size=2, tp=2), "eager"),
           "sp": (ParallelSpec(world_size=2, tp=2, sequence_parallel=True), "sdpa"),
           "fsdp_tp": (ParallelSpec(world_size=4, tp=2, strategy="fsdp"), "eager")}


def _spec(layout: str, model: str = "tiny-llama") -> TrainingSpec:
    ps, attn = LAYOUTS[layout]
    return TrainingSpec(model=model, micro_batch=2, seq_len=32, precision="fp32", attn=attn,
                        parallel=ps)


def test_trace_tier_rank_equals_the_real_runs(measured):
    """`--method trace` on tp / tp+sp: the traced rank's params, grads, AdamW state and each
    layer's saved bytes equal the independent real `parallelize_module` run above, byte for
    byte; and the traced peak on fake tensors equals the same code's peak on real tensors."""
    from hybridmem.parallel.trace_ranks import trace_rank

    for layout in ("tp", "sp"):
        fake = trace_rank(_spec(layout))
        real = measured[layout]
        assert (fake.param, fake.grad, fake.optimizer, fake.layer_saved) == (
            real["param"], real["grad"], real["optimizer"], real["layer_saved"])
        assert fake.peak(rounded=False) == trace_rank(_spec(layout), backend="real").peak(
            rounded=False)


def test_trace_tier_fsdp_times_tp_rank():
    """FSDP2 x TP 2 x 2: the traced states equal the analytic rank's (themselves equal to the
    real run, `test_fsdp_times_tp_states_equal_the_real_2x2_rank`); fake peak = real peak."""
    from hybridmem.analytic.estimate import setup as _setup
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel import ranks
    from hybridmem.parallel.layout import rank_config
    from hybridmem.parallel.trace_ranks import trace_rank

    spec = _spec("fsdp_tp")
    fake = trace_rank(spec)
    narrow = spec.with_(model=materialize_config(json.dumps(rank_config(
        load_config_dict("tiny-llama")[1], 2, 1))), parallel=ParallelSpec())
    states = ranks._states(spec, [(p.module, p.layer) for p in _setup(narrow)[1]])
    assert (fake.param, fake.grad, fake.optimizer) == (states.param, states.grad,
                                                       states.optimizer)
    assert fake.peak(rounded=False) == trace_rank(spec, backend="real").peak(rounded=False)


def test_trace_tier_answers_and_refusals():
    """The CLI's tier answers per rank with the job; HSDP (dp_replicate) gets a one-line
    refusal (cp: tests/test_parallel_cp_trace.py)."""
    from hybridmem.errors import SpecError
    from hybridmem.parallel.ranks import price_ranks
    from hybridmem.tiers import estimator

    estimate = estimator("trace")
    for layout in LAYOUTS:
        traced = estimate(_spec(layout))
        analytic = price_ranks(_spec(layout))[0]
        assert traced.method == "trace+layout" and traced.extras["per_rank"]
        assert traced.breakdown["workspace"] == analytic.breakdown["workspace"]
        ratio = analytic.peak.allocated_bytes / traced.peak.allocated_bytes
        # within 3 % (docs/parallel.md's grid); FSDP x tp with FSDP2's gathers priced per
        # timeline point (`parallel.fsdp_points`)
        assert abs(ratio - 1) < 0.03, (layout, ratio)
    with pytest.raises(SpecError, match="dp_replicate"):
        estimate(TrainingSpec(model="tiny-llama", seq_len=32, parallel=ParallelSpec(
            world_size=8, tp=2, dp_replicate=2, strategy="fsdp")))


def test_fsdp_unsharded_params_live_only_while_their_unit_runs():
    """FSDP2 frees a unit's unsharded params by resizing their storage to 0 and re-allocates
    them by resizing back (`_fsdp_param.free_storage` / `alloc_storage`), which no weakref
    sees: the rank tracker records both (`trace_ranks.fsdp_storage_events`). At the traced
    peak (the backward, one unit gathered) the live unsharded params are the root's and one
    decoder unit's (`fsdp_points.units`, from the tensors' shapes), not every unit's."""
    from hybridmem.analytic.estimate import setup as _setup
    from hybridmem.models.loader import load_config_dict, materialize_config
    from hybridmem.parallel import fsdp_points
    from hybridmem.parallel.layout import rank_config
    from hybridmem.parallel.states import layer_tensors
    from hybridmem.parallel.trace_ranks import trace_rank

    spec = _spec("fsdp_tp")
    traced = trace_rank(spec)
    peak, at = traced.peak(rounded=False)
    live = sum(s.nbytes for s in traced.tracker.live_at(at) if s.category == "param")
    narrow = spec.with_(model=materialize_config(json.dumps(rank_config(
        load_config_dict("tiny-llama")[1], 2, 1))), parallel=ParallelSpec())
    mt = layer_tensors([(p.module, p.layer) for p in _setup(narrow)[1]])
    units = fsdp_points.units(mt, (), 2, 4, 4, lambda t: 4).gathered
    root = units.pop("root")
    unit = max(units.values())
    assert len(units) == 2 and traced.tracker.phase_at(at)[0] == "backward"
    assert root + unit <= live - traced.param < root + 2 * unit
