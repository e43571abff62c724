"""`--plot`: module names must be readable (vision_tower / multi_modal_projector /
language_model overlapped on the x axis of vertical bars)."""

from __future__ import annotations

import itertools

import pytest

from hybridmem.analytic import estimate
from hybridmem.report import figure, plot
from hybridmem.job.spec import TrainingSpec


@pytest.mark.parametrize("model", ["llava-1.5-7b", "tiny-llama"])
def test_module_labels_do_not_overlap_and_stay_inside_the_figure(model, tmp_path):
    import matplotlib.pyplot as plt

    pred = estimate(TrainingSpec(model=model, micro_batch=2, seq_len=1024))
    fig = figure(pred)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = [t for t in ax.get_yticklabels() if t.get_text()]
    assert [t.get_text() for t in labels] == [m.name for m in pred.modules] + ["other"]
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert not [(a, b) for a, b in itertools.combinations(boxes, 2) if a.overlaps(b)]
    page = fig.bbox
    assert all(b.x0 >= page.x0 and b.x1 <= page.x1 for b in boxes)  # no name cut off
    longest = max(sum(getattr(m, c) for c in ("param", "grad", "optimizer", "activation"))
                  for m in pred.modules) / 2**30
    assert ax.get_xlim()[1] >= longest  # no bar runs off the axes
    plt.close(fig)
    out = plot(pred, tmp_path / "p.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_timeline_png_has_title_gib_axis_gpu_limit_and_phase_legend():
    import matplotlib.pyplot as plt

    from hybridmem.gpus import gpu_by_name
    from hybridmem.trace.timeline import figure, title_of

    gib = 2**30
    data = {"event": [0, 10, 20, 30, 40], "allocated": [1 * gib, 3 * gib, 5 * gib, 4 * gib, 2 * gib],
            "reserved": [2 * gib, 4 * gib, 6 * gib, 6 * gib, 6 * gib],
            "phases": [{"event": 0, "phase": "forward", "iteration": 0},
                       {"event": 15, "phase": "backward", "iteration": 0},
                       {"event": 35, "phase": "optimizer", "iteration": 0}]}
    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=1024, grad_ckpt=True)
    gpu = gpu_by_name("a100-40gb")
    fig = figure(data, title_of(spec), gpu)
    ax = fig.axes[0]
    assert ax.get_title().startswith("tiny-llama: train full, micro-batch 2 x 1024 tokens")
    assert "grad-ckpt" in ax.get_title()
    assert ax.get_ylabel() == "GiB"
    # the allocator's capacity: the GPU's memory less the CUDA context (allocator.overheads)
    from hybridmem.allocator.overheads import allocator_capacity

    cap = allocator_capacity(gpu) / gib
    assert cap < gpu.memory_bytes / gib
    assert max(line.get_ydata()[0] for line in ax.get_lines()
               if line.get_linestyle() == "--") == pytest.approx(cap)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"forward", "backward", "optimizer", "allocated", "reserved (simulated)"} <= set(labels)
    assert f"a100-40gb: {cap:.1f} GiB for the allocator (40.0 GiB less the CUDA context)" in labels
    plt.close(fig)
