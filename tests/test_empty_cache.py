"""`empty_cache_steps`: `torch.cuda.empty_cache()` where the loop calls it, in every tier.

Placement (`hybridmem.job.spec.empty_cache_at`): transformers `Trainer.training_step` empties
after `compute_loss`, before backward, when `state.global_step % N == 0` (global_step from 0,
constant within an accumulation window); the peft MetaMathQA benchmark (run.py) after
`optimizer.step()` when `step % N == 0` with `step` from 1, grads and outputs still alive.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridmem import SpecError, TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.intake.resolve import spec_from_cli
from hybridmem.job.spec import empty_cache_at

MiB = 1024**2


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64, **kw})


# -- the rule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("loop, n, expected", [
    # trainer: iteration % n == 0, iterations from 0 (0 % n == 0: the first step always empties)
    ("trainer", 1, ["after_forward"] * 4),
    ("trainer", 2, ["after_forward", None, "after_forward", None]),
    ("trainer", 3, ["after_forward", None, None, "after_forward"]),
    # custom: (iteration + 1) % n == 0, i.e. run.py's step = iteration + 1
    ("custom", 1, ["after_step"] * 4),
    ("custom", 2, [None, "after_step", None, "after_step"]),
    ("custom", 3, [None, None, "after_step", None]),
    ("trainer", 0, [None] * 4),
    ("custom", 0, [None] * 4),
])
def test_where_the_loop_empties(loop, n, expected):
    spec = tiny(loop=loop, empty_cache_steps=n)
    assert [empty_cache_at(spec, it) for it in range(4)] == expected


def test_default_keeps_the_spec_hash():
    # ADDED_DEFAULTS: a spec that does not use the field serialises as before
    assert "empty_cache_steps" not in tiny().to_dict()
    d = tiny(empty_cache_steps=10).to_dict()
    assert d["empty_cache_steps"] == 10
    assert TrainingSpec.from_dict(d) == tiny(empty_cache_steps=10)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_values_are_rejected(bad):
    with pytest.raises(SpecError):
        tiny(empty_cache_steps=bad)


def test_cli_and_training_args_mapping(tmp_path):
    assert spec_from_cli(model="tiny-llama", empty_cache_steps=3).empty_cache_steps == 3
    assert spec_from_cli(model="tiny-llama").empty_cache_steps == 0
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"torch_empty_cache_steps": 4}))
    assert spec_from_cli(model="tiny-llama", training_args=str(path)).empty_cache_steps == 4
    # the explicit flag wins over the file
    assert spec_from_cli(model="tiny-llama", training_args=str(path),
                         empty_cache_steps=0).empty_cache_steps == 0
    path.write_text(json.dumps({"torch_empty_cache_steps": None}))  # Trainer: never
    assert spec_from_cli(model="tiny-llama", training_args=str(path)).empty_cache_steps == 0


@pytest.mark.parametrize("args", [
    ["--empty-cache-steps", "-1"],
    ["--training-args", "ZERO"],  # torch_empty_cache_steps = 0: TrainingArguments refuses it
])
def test_cli_bad_values_exit_2_with_one_line(args, tmp_path):
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"torch_empty_cache_steps": 0}))
    args = [str(zero) if a == "ZERO" else a for a in args]
    out = subprocess.run([sys.executable, "-m", "hybridmem", "predict", "--model", "tiny-llama",
                          *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "empty_cache_steps" in lines[0], out.stderr


# -- the streams: the empty_cache event at the documented place -----------------------------

def by_hand(events: list, marks: list, loop: str) -> list:
    """`events` (no empty_cache) with ("empty_cache", 0, 0) inserted where empty_cache_steps=1
    puts it, found from the phase marks alone: `trainer` at each backward mark (after the
    forward, before anything backward allocates); `custom` at the first free, in an
    iteration's optimizer phase, of a tensor born in that iteration's backward (the grads:
    zero_grad starts there; the step's own temporaries are born in the optimizer phase)."""
    if loop == "trainer":
        at = [m for m, phase, _ in marks if phase == "backward"]
    else:
        at = []
        starts = sorted(m for m, _, _ in marks)
        for it in sorted({i for _, _, i in marks}):
            back = min(m for m, p, i in marks if p == "backward" and i == it)
            opt = next(m for m, p, i in marks if p == "optimizer" and i == it)
            end = next((m for m in starts if m > opt), len(events))
            born = {k for a, k, _ in events[back:opt] if a == "alloc"}
            at.append(next(j for j in range(opt, end)
                           if events[j][0] == "free" and events[j][1] in born))
    out, prev = [], 0
    for k in at:
        out += events[prev:k] + [("empty_cache", 0, 0)]
        prev = k
    return out + events[prev:]


trace = pytest.importorskip("hybridmem.trace")

# micro-batch 8 x 512 tokens: activations of several MiB, so emptying releases segments
STREAM_SPECS = [dict(model=m, loop=loop, precision=p, micro_batch=8, seq_len=512,
                     max_grad_norm=1.0 if loop == "custom" else 0.0)
                for m in ("tiny-llama", "tiny-llava") for loop in ("trainer", "custom")
                for p in ("fp32", "bf16")]


def _id(kw: dict) -> str:
    return "-".join(str(v) for v in kw.values())


@pytest.mark.parametrize("kw", STREAM_SPECS, ids=_id)
def test_trace_tier_replays_its_stream_with_the_empty_at_the_documented_place(kw):
    from hybridmem.allocator import replay

    base = trace.run_trace(TrainingSpec(**kw))
    res = trace.run_trace(TrainingSpec(**kw, empty_cache_steps=1))
    assert res.events == base.events  # empty_cache frees no tensor: same alloc/free stream
    hand = by_hand(res.events, res.marks, kw["loop"])
    assert sum(e[0] == "empty_cache" for e in hand) == 2  # one per iteration (N = 1)
    assert res.replay_events() == hand
    assert res.peak_reserved == replay(hand).peak_reserved
    assert res.peak_allocated == base.peak_allocated


def test_an_empty_releases_segments():
    # not a no-op: right after the custom loop's first empty_cache (grads, state and the
    # output object alive, the step's temporaries and the backward's activations cached),
    # the replay holds fewer reserved bytes than right before it
    from hybridmem.allocator import replay

    res = trace.run_trace(TrainingSpec(**STREAM_SPECS[1], empty_cache_steps=1))
    stream = res.replay_events()
    first = next(j for j, e in enumerate(stream) if e[0] == "empty_cache")
    timeline = replay(stream).timeline
    assert timeline[first][2] < timeline[first - 1][2]


@pytest.mark.parametrize("kw", STREAM_SPECS[:4], ids=_id)
def test_analytic_stream_has_the_empty_at_the_documented_place(kw):
    from hybridmem.analytic.estimate import setup
    from hybridmem.analytic.events import build

    def stream(spec, marks=None):
        _, priced, statics = setup(spec)
        return build(priced, spec, statics, marks=marks)

    marks: list = []
    base = stream(TrainingSpec(**kw), marks)
    assert not any(e[0] == "empty_cache" for e in base)  # the default adds nothing
    assert stream(TrainingSpec(**kw, empty_cache_steps=1)) == by_hand(base, marks, kw["loop"])


# -- peaks -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("kw", STREAM_SPECS[::3], ids=_id)
def test_allocated_never_changes_and_reserved_not_raised_on_the_presets(kw, n):
    # empty_cache frees no tensor: the allocated peak is the same in both tiers. On these
    # presets emptying never raises the reserved peak either; that is NOT a general property
    # (test_empty_cache_can_raise_the_reserved_peak).
    spec = TrainingSpec(**kw)
    for tier in (analytic, trace.estimate):
        before, after = tier(spec), tier(spec.with_(empty_cache_steps=n))
        assert after.peak.allocated_bytes == before.peak.allocated_bytes
        assert after.peak.reserved_bytes <= before.peak.reserved_bytes


def test_empty_cache_can_raise_the_reserved_peak(tmp_path):
    # A scaled tiny Llama (hidden 256, vocab 8192), fp32, Trainer loop, 4 x 512: emptying after
    # the forward releases the cached forward transients' segments, and the backward's
    # tensors are then cut from fresh segments that the next forward reuses worse: the
    # simulator gives 412 -> 444 MiB reserved. Kept as a fact of the allocator model (no
    # min() hides it); unverified on a GPU.
    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict("tiny-llama")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    data.update(hidden_size=256, intermediate_size=512, vocab_size=8192,
                max_position_embeddings=4096)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    spec = TrainingSpec(model=str(path), precision="fp32", micro_batch=4, seq_len=512)
    before = trace.run_trace(spec)
    after = trace.run_trace(spec.with_(empty_cache_steps=1))
    assert after.peak_allocated == before.peak_allocated
    assert after.peak_reserved > before.peak_reserved


# tolerance of tests/test_analytic_reserved.py (TINY_TOL: two 2 MiB small-pool segments)
TINY_TOL = 4 * MiB


@pytest.mark.parametrize("kw", [dict(), dict(precision="bf16", grad_ckpt=True),
                                dict(loop="custom", max_grad_norm=1.0),
                                dict(model="tiny-llama", loop="custom", precision="bf16")],
                         ids=_id)
def test_analytic_reserved_tracks_the_trace_tier(kw):
    spec = TrainingSpec(**{"model": "tiny-llava", "micro_batch": 2, "seq_len": 64, **kw,
                           "empty_cache_steps": 1})
    a, t = analytic(spec), trace.estimate(spec)
    assert abs(a.breakdown["fragmentation"] - t.breakdown["fragmentation"]) <= TINY_TOL
