"""LoRA-FA (optimizer `lora-fa`: peft `create_lorafa_optimizer`, lora_A frozen) end to end.

The trace tier runs peft's own optimizer; it must equal a real CPU run (backend "real", and
the independent `DataPtrCounter`) to the byte; the analytic tier must match the trace's
param/grad/optimizer bytes exactly and its peak within test_analytic_vs_trace.py's tolerance;
the published LoRA-FA records must import as `ok` rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridmem.analytic import estimate as analytic
from hybridmem.analytic.states import Stepped, lorafa_temporary, state_bytes
from hybridmem.errors import SpecError
from hybridmem.models import build_graph, load_config
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.trace import runner
from test_analytic_vs_trace import _check
from test_trace import real_cpu_peak, rounded

QV = LoraSpec(r=8, alpha=16, targets=("q_proj", "v_proj"))
PUBLISHED = Path("/work/shared/data/published/peft-metamathqa.jsonl")


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64,
                           "precision": "bf16", "train": "lora", "lora": QV,
                           "optimizer": "lora-fa", **kw})


def test_lora_fa_needs_lora_and_refuses_what_peft_cannot_step():
    with pytest.raises(SpecError, match=r"optimizer='lora-fa': needs train='lora'"):
        TrainingSpec(model="tiny-llama", optimizer="lora-fa")
    with pytest.raises(SpecError, match="bf16-master"):
        tiny(precision="bf16-master")
    with pytest.raises(SpecError, match="DoRA"):
        tiny(lora=LoraSpec(use_dora=True))
    spec = tiny()
    assert TrainingSpec.from_dict(spec.to_dict()) == spec


def test_graph_freezes_lora_a_only():
    graph = build_graph(tiny())
    lora = [p for _, layer in graph.layers() for p in layer.lora]
    assert lora and all(p.frozen == ("lora_A" in p.name) for p in lora)
    graded = [p.name for _, layer in graph.layers() for p in layer.grad_tensors]
    assert graded and all("lora_B" in n for n in graded)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_trace_equals_a_real_cpu_run(precision):
    spec = tiny(precision=precision, loop="custom", max_grad_norm=1.0)
    config = load_config(spec.model)
    curves = {}
    for backend in ("fake", "meta", "real"):
        tracker, job = runner.trace(spec, config, backend=backend)
        curves[backend] = (tracker.live_curve(device_only=False), tracker, job)
    fake, tracker, job = curves["fake"]
    real = curves["real"][0]
    assert np.array_equal(fake, real)  # every allocation and free, to the byte
    assert int(fake.max()) == real_cpu_peak(spec) == int(curves["meta"][0].max())
    # the step itself: meta (CUDA autocast emulated) casts in another order, same peak
    start = [i for i, p, _ in tracker.marks if p == "optimizer"][-1]
    end = job.after_step[-1]
    meta, mtracker, mjob = curves["meta"]
    assert int(meta[start:end + 1].max()) == int(fake[start:end + 1].max())

    # peft froze every lora_A; lora_B alone trains and gets state exp_avg_B, exp_avg_sq_B
    names = [n for n, p in job.model.named_parameters() if "lora_" in n]
    assert names and all(("lora_A" in n) != p.requires_grad
                         for n, p in job.model.named_parameters() if "lora_" in n)
    assert all("lora_B" in n for n, _ in job.trainable)
    b = {n.split(".lora_B")[0] + ".lora": p for n, p in job.trainable}
    assert set(job.optimizer.state) == set(b)
    for key, st in job.optimizer.state.items():
        assert set(st) == {"step", "exp_avg_B", "exp_avg_sq_B"}
        assert all(st[k].shape == b[key].shape and st[k].dtype == torch.float32
                   for k in ("exp_avg_B", "exp_avg_sq_B"))
    # the projection ran under bf16 autocast, as on a bf16-capable GPU: a bf16 (out x r)
    # product per pair in the step
    out_r = {rounded(p.numel() * 2) for p in b.values()}
    step_mm = [s for s in tracker.storages if s.phase == "optimizer"
               and "mm" in str(s.op) and s.nbytes in out_r]
    assert len(step_mm) == len(b) * runner.ITERATIONS


@pytest.mark.parametrize("kw", [
    dict(),
    dict(precision="fp32", loop="custom", max_grad_norm=1.0),
    dict(precision="bf16-mixed"),
    dict(model="tiny-llava", precision="bf16-mixed", lora=LoraSpec(r=4)),
    dict(model="tiny-llava", precision="fp32", grad_ckpt=True, loop="custom",
         max_grad_norm=1.0, grad_accum=2),
    dict(precision="fp32", lora=LoraSpec(r=4, targets=("q_proj",),
                                         modules_to_save=("lm_head",))),
], ids=lambda kw: "-".join(str(v) for v in kw.values()) or "default")
def test_analytic_matches_trace(kw):
    spec = tiny(**kw)
    _check({f: v for f, v in spec.to_dict().items() if f not in ("parallel",)}
           | {"lora": spec.lora})


def test_lora_fa_saves_the_adapter_inputs_and_a_state():
    """Against plain AdamW LoRA: per adapted linear, lora_A's grad (r x in fp32) and its two
    AdamW states are gone, and the fp32 `_cast_input_dtype` copy of the input (B x in) that
    lora_A saved for its weight grad (bf16 model, no dropout)."""
    spec = tiny()
    adamw = spec.with_(optimizer="adamw")
    a, b = analytic(adamw), analytic(spec)
    tokens, h, r = 2 * 64, 64, 8
    adapters = 2 * 2  # q_proj, v_proj in each of 2 layers
    assert a.breakdown["optimizer"] - b.breakdown["optimizer"] == adapters * 2 * rounded(r * h * 4)
    saved = {m.name: m.activation for m in a.modules}["language_model"] - \
        {m.name: m.activation for m in b.modules}["language_model"]
    assert saved == adapters * rounded(tokens * h * 4)


def test_state_and_step_temporaries():
    s = Stepped(64 * 8, (64, 8), 4, lora_b=True)
    assert state_bytes(s, "lora-fa") == [rounded(64 * 8 * 4)] * 2  # `step` is a Python int
    one = lorafa_temporary([s])
    # AA_T + pinv's four r x r tensors and result, then bf16 product + casts: at least the
    # fp32 grad_B and denom_B, at most all of the named tensors at once
    assert 2 * rounded(64 * 8 * 4) <= one <= 8 * rounded(64 * 8 * 4)
    assert lorafa_temporary([s, s]) > one  # the previous pair's grad_B / denom_B live on


@pytest.mark.skipif(not PUBLISHED.exists(), reason="published records not on this machine")
def test_published_lorafa_records_import_as_ok_rows():
    from hybridmem.published import peft_metamathqa

    records = [json.loads(line) for line in PUBLISHED.read_text().splitlines() if line.strip()]
    lorafa = [r for r in records if r.get("optimizer") == "lora-fa"]
    assert len(lorafa) == 4
    for rec in lorafa:
        row = peft_metamathqa.row(rec)
        assert row["outcome"] == "ok", row.get("excluded_reason")
        spec = TrainingSpec.from_dict(json.loads(row["spec_json"]))
        assert spec.optimizer == "lora-fa" and spec.train == "lora"
        assert (spec.lora.r, spec.lora.alpha) == (rec["optimizer_kwargs"]["r"],
                                                 rec["optimizer_kwargs"]["lora_alpha"])
        assert spec.lora.targets == ("q_proj", "v_proj")


def test_harness_builds_peft_lorafa_and_steps():
    """The CUDA harness's job (run here on the CPU): peft's LoraFAOptimizer, lora_A frozen,
    only lora_B stepped and clipped."""
    from peft.optimizers.lorafa import LoraFAOptimizer

    from hybridmem.harness import workload

    spec = tiny(precision="fp32", loop="custom", max_grad_norm=1.0)
    device = torch.device("cpu")
    job = workload.prepare(spec, load_config(spec.model), device)
    assert isinstance(job.optimizer, LoraFAOptimizer)
    named = dict(job.model.named_parameters())
    assert job.params and all(any(p is q for n, q in named.items() if "lora_B" in n)
                              for p in job.params)
    before = {n: p.detach().clone() for n, p in named.items() if "lora_" in n}
    workload.backward(job, workload.forward(job, spec, device), spec)
    workload.optimizer_step(job, spec)
    changed = {n for n, p in named.items() if "lora_" in n and not torch.equal(p, before[n])}
    assert changed and all("lora_B" in n for n in changed)
    assert len(job.optimizer.state) == len(job.params)
