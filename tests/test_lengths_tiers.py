"""--lengths: where the analytic and trace tiers agree on a run's reserved peak, and the tier
chooser for a run whose growth the closed form does not price (`hybridmem/batches/scope.py`,
docs/lengths.md "Why the tiers disagree").

Every length file here is SYNTHETIC (made in the test, log-normal, seed 0): no dataset's.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridmem.batches.scope import closed_form_gap, later_larger_step
from hybridmem.batches.steps import Shape, Steps
from hybridmem.intake.resolve import choose_method
from hybridmem.job.spec import TrainingSpec
from hybridmem.predict import predict


@pytest.fixture(scope="module")
def lengths(tmp_path_factory):
    path = tmp_path_factory.mktemp("lengths") / "synthetic.txt"
    rng = np.random.default_rng(0)
    path.write_text("\n".join(map(str, np.maximum(rng.lognormal(5.0, 0.5, 48).astype(int), 8))))
    return str(path)


def _job(lengths, sampler):
    # a LoRA job shaped like experiments/bench_lengths.py's, small enough to trace in seconds;
    # pad_multiple keeps it to two shapes (256, 512 tokens)
    return TrainingSpec(model="smollm2-135m", train="lora", precision="bf16", micro_batch=4,
                        seq_len=512, loop="custom", max_grad_norm=1.0, lengths=lengths,
                        sampler=sampler, pad_multiple=256)


def test_grouped_cell_agrees_within_5_percent(lengths):
    # group_by_length puts the longest sample first: the first step has the run's largest
    # shape, so every later step fits in segments carved for it (batches/scope.py). Measured
    # (this test's job, simulated allocator): trace 4,657,774,592 B, analytic 4,661,313,536 B
    # reserved over the run (+0.08 %), growth 0 on both; experiments/lengths_grid.py gives
    # -0.5 % to +1.4 % on the grouped cells of 0.5B-8B decoders (docs/lengths.md)
    spec = _job(lengths, "group_by_length")
    assert closed_form_gap(spec) is None
    assert choose_method(spec).method != "trace"
    trace, analytic = (predict(spec, method=m) for m in ("trace", "analytic"))
    t, a = trace.peak.reserved_bytes, analytic.peak.reserved_bytes
    assert abs(a / t - 1) < 0.05, (a, t)
    for run in (trace, analytic):
        info = run.extras["lengths"]
        assert info["longest_batch"]["first_step"] == 0
        assert info["closed_form_gap"] is None
        assert info["shape_growth_bytes"] < 0.05 * t


def test_run_with_a_later_larger_step_goes_to_the_trace_tier(tmp_path):
    path = tmp_path / "short-then-long.txt"  # in dataset order: 4 x 256, then 4 x 512 tokens
    path.write_text("".join(f"{n}\n" for n in [40] * 4 + [300] * 4))
    spec = _job(str(path), "sequential")
    gap = closed_form_gap(spec)
    assert gap is not None and gap.startswith("step 1 (4 x 512 tokens) is larger than every")
    choice = choose_method(spec)
    assert choice.method == "trace" and "closed form does not price" in choice.note
    assert choose_method(spec, "analytic").method == "analytic"  # --method still decides
    forced = predict(spec, method="analytic")
    assert forced.extras["lengths"]["closed_form_gap"] == gap
    assert any("--method trace prices it" in n for n in forced.notes)


def _steps(tokens):
    shapes = tuple(Shape(4, t, -1) for t in sorted(set(tokens)))
    index = np.array([sorted(set(tokens)).index(t) for t in tokens])
    return Steps(shapes, index, np.array(tokens), 4 * len(tokens), 1, len(tokens))


@pytest.mark.parametrize("tokens, at", [
    ([512, 128, 256, 512], None),  # the first step is the largest
    ([128, 128, 64], None),
    ([256, 128, 512, 64], 2),  # step 2 needs segments no earlier step carved
    ([128, 256], 1),
])
def test_later_larger_step(tokens, at):
    assert later_larger_step(_steps(tokens)) == at


def test_jobs_without_lengths_have_no_gap():
    assert closed_form_gap(TrainingSpec(model="tiny-llama")) is None
