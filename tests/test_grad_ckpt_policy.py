"""Selective (layer-level) activation checkpointing: `--grad-ckpt-policy full|every:N`.

`every:N` checkpoints the checkpointable layers 0, N, 2N, ... counted over the whole model in
module order, as transformers' `_set_gradient_checkpointing(every_n_layers=N)` counts them
(modeling_utils.py): `hybridmem.job.spec.ckpt_layer`, used by the analytic graph, the trace tier and
the CUDA harness.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridmem import TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.analytic.estimate import price
from hybridmem.errors import SpecError
from hybridmem.models import build_graph, load_config
from hybridmem.intake.merge import spec_from_inputs
from hybridmem.job.spec import ckpt_every, ckpt_layer

trace = pytest.importorskip("hybridmem.trace")
from hybridmem.trace import corrections, runner  # noqa: E402
from hybridmem.job.checkpointing import select_checkpointed  # noqa: E402

from test_analytic_vs_trace import _check  # noqa: E402
from test_trace import real_cpu_peak  # noqa: E402


def spec(model: str = "tiny-llama", policy: str | None = "full", **kw) -> TrainingSpec:
    ckpt = {} if policy is None else {"grad_ckpt": True, "grad_ckpt_policy": policy}
    return TrainingSpec(**{"model": model, "micro_batch": 2, "seq_len": 64,
                           "precision": "bf16-mixed", **ckpt, **kw})


# --- the spec ---------------------------------------------------------------------------

def test_policy_syntax():
    assert ckpt_every("full") == 1
    assert ckpt_every("every:1") == 1
    assert ckpt_every("every:12") == 12
    for bad in ("every:0", "every:-2", "every:x", "every:", "every:1.5", "every:２", "half", 2,
                None):
        with pytest.raises(SpecError, match=r"^grad_ckpt_policy=.*\(valid: full, every:N, ops\)$"):
            ckpt_every(bad)
    assert ckpt_every("ops") == 1  # every layer, op-level (techniques.sac)


def test_policy_needs_grad_ckpt():
    with pytest.raises(SpecError, match=r"^grad_ckpt_policy='every:2': needs grad_ckpt"):
        TrainingSpec(model="tiny-llama", grad_ckpt_policy="every:2")
    TrainingSpec(model="tiny-llama", grad_ckpt_policy="full")  # the default, with or without


def test_default_policy_keeps_the_spec_hash():
    # an added field at its default stays out of to_dict (ADDED_DEFAULTS), so old rows'
    # spec hashes, and --resume, do not change
    assert "grad_ckpt_policy" not in spec(policy="full").to_dict()
    d = spec(policy="every:2").to_dict()
    assert d["grad_ckpt_policy"] == "every:2"
    assert TrainingSpec.from_dict(d) == spec(policy="every:2")


def test_merge_takes_the_flag():
    s = spec_from_inputs(overrides={"model": "tiny-llama", "grad_ckpt": True,
                                    "grad_ckpt_policy": "every:3"})
    assert s.grad_ckpt_policy == "every:3"


def test_ckpt_layer_rule():
    s2 = spec(policy="every:2")
    assert [ckpt_layer(s2, i) for i in range(5)] == [True, False, True, False, True]
    assert all(ckpt_layer(spec(policy="full"), i) for i in range(5))
    assert not any(ckpt_layer(spec(policy=None), i) for i in range(5))


# --- which layers: one rule, both tiers ----------------------------------------------------

# tiny-llava: 3 CLIP encoder layers, then 2 decoder layers, one count (module order:
# model.vision_tower before model.language_model), ordinals 0..4.
#   every:2 -> ordinals 0, 2, 4 = vision 0, vision 2, decoder 1
#   every:3 -> ordinals 0, 3    = vision 0, decoder 0
# tiny-llama: 2 decoder layers; every:2 and every:3 -> layer 0 only.
PICKED = {
    ("tiny-llava", "every:2"): ["vision_tower.encoder.layers.0", "vision_tower.encoder.layers.2",
                                "language_model.layers.1"],
    ("tiny-llava", "every:3"): ["vision_tower.encoder.layers.0", "language_model.layers.0"],
    ("tiny-llava", "full"): ["vision_tower.encoder.layers.0", "vision_tower.encoder.layers.1",
                             "vision_tower.encoder.layers.2", "language_model.layers.0",
                             "language_model.layers.1"],
    ("tiny-llama", "every:2"): ["language_model.layers.0"],
    ("tiny-llama", "every:3"): ["language_model.layers.0"],
}


@pytest.mark.parametrize("model, policy", sorted(PICKED))
def test_both_tiers_checkpoint_the_same_layers(model, policy):
    s = spec(model, policy)
    picked = [f"{p.module}.{p.layer.name}" for p in price(build_graph(s), s) if p.step.ckpt]
    assert picked == PICKED[model, policy]
    with corrections.patched_model_checks():
        job = runner.prepare(s, load_config(model))
    names = [n.removeprefix("model.") for n in select_checkpointed(job.model, s)]
    # a llama decoder's layers are model.layers.i (the analytic graph's language_model.layers.i)
    names = [n if n.startswith(("vision_tower", "language_model")) else f"language_model.{n}"
             for n in names]
    assert names == PICKED[model, policy]


# --- peaks ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava"])
@pytest.mark.parametrize("policy", ["every:1", "every:2"])
def test_trace_peak_equals_real_cpu_run(model, policy):
    s = spec(model, policy)
    tracker, _ = runner.trace(s, load_config(model))
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(s)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava"])
def test_every_1_is_full(model):
    full, one = spec(model, "full"), spec(model, "every:1")
    for tier in (analytic, trace.estimate):
        a, b = tier(full), tier(one)
        assert a.peak == b.peak
        assert a.breakdown == b.breakdown


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava"])
@pytest.mark.parametrize("policy", ["every:2", "every:3"])
def test_analytic_matches_trace(model, policy):
    _check(dict(model=model, precision="bf16-mixed", grad_ckpt=True, grad_ckpt_policy=policy))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava"])
def test_peak_between_none_and_full(model):
    # fewer checkpointed layers keep more saved tensors: none >= every:N >= full; every:2 on
    # these models checkpoints some but not all layers that carry activations, so the trace
    # peak is strictly between
    for tier in (analytic, trace.estimate):
        none, full = (tier(spec(model, p)).peak.allocated_bytes for p in (None, "full"))
        assert none > full
        for policy in ("every:2", "every:3"):
            mid = tier(spec(model, policy)).peak.allocated_bytes
            assert none >= mid >= full, (tier, policy)
    mid = trace.estimate(spec(model, "every:2")).peak.allocated_bytes
    none, full = (trace.estimate(spec(model, p)).peak.allocated_bytes for p in (None, "full"))
    assert none > mid > full


# --- the CLI ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--grad-ckpt", "--grad-ckpt-policy", "every:0"],
     "error: grad_ckpt_policy='every:0': give full or every:N with N a positive integer "
     "(valid: full, every:N, ops)"),
    (["--grad-ckpt-policy", "every:2"],
     "error: grad_ckpt_policy='every:2': needs grad_ckpt (--grad-ckpt) (valid: full, every:N, ops)"),
])
def test_bad_policy_exits_2_with_one_line(argv, match):
    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", "--model",
                           "tiny-llama", "--seq-len", "32", "--method", "analytic", *argv],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == match + "\n"


@pytest.mark.parametrize("args, expected", [
    # transformers 5.x names; the deprecated gradient_checkpointing* aliases read the same
    ({"activation_checkpointing": True,
      "activation_checkpointing_kwargs": {"every_n_layers": 2, "use_reentrant": False}},
     (True, "every:2")),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": '{"every_n_layers": 1}'},
     (True, "full")),
    ({"activation_checkpointing": False, "gradient_checkpointing": True}, (False, "full")),
])
def test_training_args_checkpointing_gives_the_flags_answer(args, expected):
    from hybridmem.intake.merge import spec_from_inputs

    spec = spec_from_inputs(training_args=args, overrides={"model": "tiny-llama"})
    assert (spec.grad_ckpt, spec.grad_ckpt_policy) == expected
    if expected[0]:
        flags = spec_from_inputs(training_args={}, overrides={
            "model": "tiny-llama", "grad_ckpt": True, "grad_ckpt_policy": expected[1]})
        assert spec == flags


@pytest.mark.parametrize("kwargs, field", [
    ({"offload": "yes"}, "training_args.activation_checkpointing_kwargs.offload"),
    ({"every_n_layers": 0}, "training_args.activation_checkpointing_kwargs.every_n_layers"),
])
def test_training_args_checkpointing_bad_kwargs_name_the_field(kwargs, field):
    from hybridmem.errors import SpecError
    from hybridmem.intake.merge import spec_from_inputs

    with pytest.raises(SpecError) as err:
        spec_from_inputs(training_args={"activation_checkpointing": True,
                                        "activation_checkpointing_kwargs": kwargs},
                         overrides={"model": "tiny-llama"})
    assert err.value.field == field
