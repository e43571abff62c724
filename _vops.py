import collections, sys, torch
sys.path.insert(0, "tests")
from test_trace import tiny
from hybridmem.trace import runner, corrections
from hybridmem.trace.tracker import StorageTracker
from hybridmem.models.loader import load_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
kw = dict(precision="bf16-mixed", attn="sdpa", optimizer="adamw", train="llm+projector", grad_ckpt=True)
spec = tiny(**kw)
class Ops(TorchDispatchMode):
    def __init__(s): super().__init__(); s.c = collections.Counter()
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                s.c[(str(func), t.untyped_storage().nbytes(), str(t.dtype))] += 1
        return out
mode = sys.argv[1]
if mode == "real":
    torch.manual_seed(0)
    with corrections.patched_model_checks():
        job = runner.prepare(spec, load_config(spec.model))
        o = Ops()
        with StorageTracker() as labels, o:
            runner.train(job, spec, labels, runner.ITERATIONS)
else:
    o = Ops()
    import hybridmem.trace.runner as R
    orig = R.train
    def tr(*a, **k):
        with o: return orig(*a, **k)
    R.train = tr
    runner.trace(spec, load_config(spec.model))
for k, v in sorted(o.c.items()): print(k, v)
