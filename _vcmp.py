import sys, transformers
sys.path.insert(0, "tests")
from test_trace import tiny, real_cpu_peak
from hybridmem.trace import runner
from hybridmem.models.loader import load_config
for kw in [dict(precision="bf16-mixed", attn="sdpa", optimizer="adamw", train="llm+projector", grad_ckpt=True),
           dict(precision="fp32", attn="sdpa", optimizer="adamw", micro_batch=8, seq_len=256)]:
    spec = tiny(**kw)
    tr, _ = runner.trace(spec, load_config(spec.model))
    print(transformers.__version__, kw, "trace", int(tr.live_curve(device_only=False).max()), "real", real_cpu_peak(spec), flush=True)
