"""`--find-max-batch --method trace`: started at the analytic tier's answer, few trace probes,
the same answer as the plain exponential + bisection search."""

from __future__ import annotations

import pytest

import hybridmem.trace
from hybridmem.gpus import custom_gpu
from hybridmem.predict import MAX_SEARCH_BATCH, find_max_micro_batch, search_max
from hybridmem.job.spec import TrainingSpec


def _counted(answer: int):
    calls = []

    def fits(b: int) -> bool:
        calls.append(b)
        return b <= answer
    return fits, calls


@pytest.mark.parametrize("answer", [0, 1, 2, 7, 30, 31, 100, MAX_SEARCH_BATCH])
@pytest.mark.parametrize("guess", [None, 1, 5, 30, 33, 1000, MAX_SEARCH_BATCH + 5])
def test_guided_search_equals_plain(answer, guess):
    plain, _ = _counted(answer)
    guided, calls = _counted(answer)
    assert search_max(guided, guess) == search_max(plain) == answer
    if guess == answer and 0 < answer < MAX_SEARCH_BATCH:
        assert len(calls) == 2  # the guess fits, guess + 1 does not


def test_trace_search_probes_few_micro_batches(monkeypatch):
    """tiny-llama on a 0.7 GiB device: the analytic tier says 30 (measured when this test was
    written); the trace search probes a handful of batches near it, not ~2 log2(30) = 10."""
    spec = TrainingSpec(model="tiny-llama", seq_len=512)
    gpu = custom_gpu(0.7)
    probes = []
    real = hybridmem.trace.estimate

    def counting(s, **kw):
        probes.append(s.micro_batch)
        return real(s, **kw)

    monkeypatch.setattr(hybridmem.trace, "estimate", counting)
    guided = find_max_micro_batch(spec, gpu, "trace")
    guided_probes = list(probes)
    probes.clear()
    plain = search_max(lambda b: real(spec.with_(micro_batch=b), gpu=gpu).peak.device_bytes
                       <= gpu.memory_bytes)
    assert guided == plain > 0
    assert len(guided_probes) <= 6, guided_probes
