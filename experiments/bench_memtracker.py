"""PyTorch's own `MemTracker` under FakeTensorMode beside our tracker, same configs, same loop.

Both run the identical training loop (`hybridmem.trace.runner`) on the identical fake model;
MemTracker (torch/distributed/_tools/mem_tracker.py) attributes by its own categories and does
not round CPU-device storages, so our unrounded peak is printed next to it as well as our
512 B-rounded one. Times are for the training iterations only (model build excluded, same for
both).

The "fast path" column times the whole tier, `hybridmem.trace.estimate(spec)` (meta tensors, a few
layers traced and the rest repeated where hybridmem/trace/repeat.py can, allocator replay included).

    python experiments/bench_memtracker.py [--iterations 2] [--out experiments/results/memtracker]

Writes `<out>.json` and `<out>.md` (the table docs/trace.md cites).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
import contextlib
import os
from pathlib import Path
import time

import torch

from hybridmem.models import load_config
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import runner
from hybridmem.trace.tracker import StorageTracker
from doc_block import write_results  # experiments/ is on the path of a script run

CONFIGS = (
    TrainingSpec(model="llava-1.5-7b"),  # the README's step (spec defaults)
    TrainingSpec(model="llava-1.5-7b", micro_batch=8, seq_len=2048, train="llm+projector",
                 grad_ckpt=True),
    TrainingSpec(model="llama-3.2-3b", micro_batch=1, seq_len=1024, precision="bf16"),
    TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=64, precision="fp32"),
)


class NoTracker(StorageTracker):
    """The runner's hooks (marks, labels) with no recording, for MemTracker's run."""

    def mark(self, *a): pass
    def label(self, *a): pass
    def label_alive_since(self, *a): pass
    def add_external(self, *a): pass


@contextlib.contextmanager
def hooks_on_frozen_params_ignored():
    """MemTracker registers a grad hook on every parameter of a module (mem_tracker.py
    `_track_module_params_and_buffers`), which raises for frozen ones (a frozen vision tower);
    give those a no-op handle so it can run on LLaVA's `llm+projector` at all."""
    names = ("register_hook", "register_post_accumulate_grad_hook")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def guarded(name):
        def register(self, hook):
            if not self.requires_grad:
                return torch.utils.hooks.RemovableHandle(OrderedDict())  # weakref-able
            return saved[name](self, hook)
        return register

    for n in names:
        setattr(torch.Tensor, n, guarded(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def run(spec: TrainingSpec, iterations: int, which: str) -> tuple[float, dict]:
    config = load_config(spec.model)
    backend = "meta" if which == "ours-meta" else "fake"
    with hooks_on_frozen_params_ignored(), runner.prepared(spec, config, backend) as job:
        if which.startswith("ours"):
            tracker = StorageTracker()
            for t in [*job.model.parameters(), *job.model.buffers(),
                      *(v for v in job.batch.values() if hasattr(v, "untyped_storage"))]:
                tracker.label(t, "param")
            ctx, watcher = tracker, tracker
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            ctx = MemTracker()
            ctx.track_external(job.model, job.optimizer,
                               *(v for v in job.batch.values() if hasattr(v, "untyped_storage")))
            watcher = NoTracker()
        start = time.perf_counter()
        peak = 0
        with ctx:
            if which.startswith("ours"):
                runner.train(job, spec, watcher, iterations)
            else:  # MemTracker refuses a 2nd forward unless its module stats are reset
                for _ in range(iterations):
                    runner.train(job, spec, watcher, 1)
                    snap = ctx.get_tracker_snapshot("peak")
                    peak = max(peak, sum(v.get("Total", 0) for v in snap.values()))
                    ctx.reset_mod_stats()
        seconds = time.perf_counter() - start
    if which.startswith("ours"):
        return seconds, {"rounded": int(tracker.live_curve(False).max()),
                         "raw": int(tracker.live_curve(False, rounded=False).max())}
    return seconds, {"raw": int(peak)}


def fast_path(spec: TrainingSpec) -> float:
    """Seconds of the whole trace tier (`hybridmem.trace.estimate`) on `spec`."""
    from hybridmem.trace import estimate

    start = time.perf_counter()
    estimate(spec)
    return time.perf_counter() - start


def _name(spec: TrainingSpec) -> str:
    return (f"{spec.model} mb {spec.micro_batch}, seq {spec.seq_len}, {spec.precision}, "
            f"{spec.train}{', ckpt' if spec.grad_ckpt else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--only", default=None, help="config index (0-based) to run alone")
    ap.add_argument("--out", default="experiments/results/memtracker")
    args = ap.parse_args()
    gib = 2**30
    load = os.getloadavg()[0]
    fast_path(TrainingSpec(model="tiny-llama"))  # the tier's own lazy imports, not timed
    rows = []
    for i, spec in enumerate(CONFIGS):
        if args.only is not None and str(i) not in args.only.split(","):
            continue
        t_fast = fast_path(spec)
        t_meta, meta = run(spec, args.iterations, "ours-meta")
        t_ours, ours = run(spec, args.iterations, "ours")
        t_mt, mt = run(spec, args.iterations, "memtracker")
        row = {"config": _name(spec), "fast_path_s": t_fast, "meta_s": t_meta, "fake_s": t_ours,
               "memtracker_s": t_mt, "peak_raw": ours["raw"], "peak_meta_raw": meta["raw"],
               "memtracker_raw": mt["raw"], "diff": ours["raw"] - mt["raw"]}
        rows.append(row)
        print(f"{row['config']}:\n"
              f"  ours, whole tier (fast path) {t_fast:6.1f} s\n"
              f"  ours (fake) {t_ours:6.1f} s  peak {ours['raw'] / gib:9.4f} GiB raw, "
              f"{ours['rounded'] / gib:9.4f} GiB 512-rounded\n"
              f"  ours (meta) {t_meta:6.1f} s  peak {meta['raw'] / gib:9.4f} GiB raw, "
              f"{meta['rounded'] / gib:9.4f} GiB 512-rounded\n"
              f"  MemTracker  {t_mt:6.1f} s  peak {mt['raw'] / gib:9.4f} GiB raw "
              f"(ours - MemTracker: {ours['raw'] - mt['raw']:+d} B)", flush=True)
        write(Path(args.out), load, args.iterations, rows)  # after each row: a long run's partial


def write(out: Path, load: float, iterations: int, rows: list[dict]) -> None:
    gib = 2**30
    meta_info = {"when": time.strftime("%Y-%m-%d %H:%M"), "load_average_at_start": load,
                 "cpus": os.cpu_count(), "iterations": iterations, "rows": rows}
    write_results(out, meta_info,
                  f"Measured {meta_info['when']}, {meta_info['cpus']} CPUs, load average "
                  f"{load:.1f} at start; one run each, {iterations} iterations.",
                  "| config | ours, whole tier (fast path) | ours, meta | ours, fake | MemTracker | "
                  "peak (ours, raw bytes) | ours - MemTracker |",
                  [f"| {r['config']} | {r['fast_path_s']:.1f} s | {r['meta_s']:.1f} s | "
                   f"{r['fake_s']:.1f} s | {r['memtracker_s']:.1f} s | "
                   f"{r['peak_raw'] / gib:.4f} GiB | {r['diff']:+,d} B |" for r in rows])


if __name__ == "__main__":
    main()
