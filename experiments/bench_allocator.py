"""Speed of the allocator simulator: replay 10^5 alloc/free events (goal: well under 1 s).

A 7B training trace has ~10^5 alloc/free events (docs/design.md, "Facts measured or read"). The synthetic stream
mimics one: long-lived parameter-sized blocks, activations freed in reverse order (backward),
short-lived temporaries, sizes from 512 B to 200 MiB. Run: `python experiments/bench_allocator.py`;
`--trace-model llava-1.5-7b` replays the trace tier's own stream for that model instead
(seq 2048, micro-batch 8, llm+projector, checkpointing; the trace itself takes ~10 s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hybridmem.allocator import AllocatorConfig, replay

MiB = 1 << 20


def synthetic_stream(n_events: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """Alloc/free events shaped like a training step (see module docstring)."""
    rng = random.Random(seed)
    events, live, key = [], [], 0

    def size() -> int:
        kind = rng.random()
        if kind < 0.5:
            return rng.randint(1, 1 * MiB)  # small pool: biases, norms, scalars
        if kind < 0.9:
            return rng.randint(1 * MiB, 64 * MiB)  # activations, weight matrices
        return rng.randint(64 * MiB, 200 * MiB)  # logits, embeddings

    for _ in range(2000):  # parameters: never freed
        events.append(("alloc", key, size()))
        key += 1
    while len(events) < n_events:
        if live and rng.random() < 0.48:
            # mostly LIFO (backward frees activations in reverse), sometimes a random one
            idx = -1 if rng.random() < 0.8 else rng.randrange(len(live))
            events.append(("free", live.pop(idx), 0))
        else:
            events.append(("alloc", key, size()))
            live.append(key)
            key += 1
    return events


def trace_stream(model: str) -> list[tuple[str, int, int]]:
    """The alloc/free stream the trace tier records for `model` (two training iterations)."""
    from hybridmem.job.spec import TrainingSpec
    from hybridmem.trace import run_trace

    spec = TrainingSpec(model=model, seq_len=2048, micro_batch=8, train="llm+projector",
                        grad_ckpt=True)
    return run_trace(spec).events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--trace-model", default=None, help="replay a real trace of this preset")
    args = parser.parse_args()
    events = trace_stream(args.trace_model) if args.trace_model else synthetic_stream(args.events)
    configs = {
        "default": AllocatorConfig(),
        "max_split_size_mb=128": AllocatorConfig(max_split_size_mb=128),
        "roundup_power2_divisions=4": AllocatorConfig(roundup_power2_divisions=4),
        "expandable_segments": AllocatorConfig(expandable_segments=True),
    }
    print(f"{len(events)} events, median of {args.repeat} runs")
    for name, config in configs.items():
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = replay(events, config)
            times.append(time.perf_counter() - start)
        gib = 2**30
        print(f"{name:28s} {statistics.median(times):6.3f} s   peak allocated "
              f"{result.peak_allocated / gib:7.2f} GiB  "
              f"reserved {result.peak_reserved / gib:7.2f} GiB")


if __name__ == "__main__":
    main()
