import collections, sys, torch
sys.path.insert(0, "tests")
from test_trace import DataPtrCounter, tiny
from hybridmem.trace import runner, corrections
from hybridmem.trace.tracker import StorageTracker
from hybridmem.models.loader import load_config
from hybridmem.allocator import *  # noqa
kw = dict(precision="bf16-mixed", attn="sdpa", optimizer="adamw", train="llm+projector", grad_ckpt=True)
spec = tiny(**kw)
tr, _ = runner.trace(spec, load_config(spec.model))
curve = tr.live_curve(device_only=False)
import numpy as np
pk = int(np.argmax(curve))
print("fake peak", int(curve.max()), "at", pk, len(tr.events))
from test_trace import rounded
class C(DataPtrCounter):
    def _add(self, st):
        ptr = st.data_ptr()
        if st.nbytes() == 0 or ptr in self.live: return
        self.live[ptr] = rounded(st.nbytes()); self.current += self.live[ptr]
        if self.current > self.peak: self.peak = self.current; self.snap = sorted(self.live.values())
        import weakref; weakref.finalize(st, self._drop, ptr)
torch.manual_seed(0)
with corrections.patched_model_checks():
    job = runner.prepare(spec, load_config(spec.model))
    start = [*job.model.parameters(), *job.model.buffers(), *job.masters, *(t for t in job.batch.values() if isinstance(t, torch.Tensor))]
    c = C(start)
    with StorageTracker() as labels, c:
        runner.train(job, spec, labels, runner.ITERATIONS)
print("real peak", c.peak)
# fake live at peak
alive = set()
best = (0, None); cur = 0
for i, e in enumerate(tr.events):
    if e >= 0: alive.add(e)
    else: alive.discard(~e)
    s = sum(rounded(tr.storages[x].nbytes) for x in alive)
    if s > best[0]: best = (s, sorted(rounded(tr.storages[x].nbytes) for x in alive), [(tr.storages[x].phase, tr.storages[x].category) for x in alive])
fs = collections.Counter(best[1]); rs = collections.Counter(c.snap)
print("fake-only", fs - rs); print("real-only", rs - fs)
print("fake phases", collections.Counter(best[2]))
