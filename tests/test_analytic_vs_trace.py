"""The analytic tier against the trace tier (the oracle: the real HF training step under
FakeTensorMode, CUDA rules applied) on a grid of tiny configs.

Param, grad and optimizer factors must match exactly (per module). The allocated peak must
agree within 5%, and so must the tensor part of it (allocated minus the two cuBLAS workspaces
both tiers add; 64 MiB would otherwise hide any error on models this small).
`experiments/analytic_vs_trace.py` prints the distribution over the grid.
"""

from __future__ import annotations

import itertools

import pytest

from hybridmem import TrainingSpec
from hybridmem.job.spec import LoraSpec
from hybridmem.analytic import estimate as analytic

trace = pytest.importorskip("hybridmem.trace")

TOL = 0.05
MODELS = {"tiny-llava": ("full", "llm+projector", "projector", "lora"),
          "tiny-llama": ("full", "lora")}
GRID = [dict(model=m, train=tr, precision=p, optimizer=o, grad_ckpt=c)
        for m, trains in MODELS.items()
        for tr, p, o, c in itertools.product(trains, ("fp32", "bf16", "bf16-mixed"),
                                             ("adamw", "adamw-fused", "sgd"), (False, True))]
# beyond the grid: eager attention, a SigLIP tower, LLaVA-NeXT anyres, other optimizers and
# bf16 master weights, other shapes
EXTRA = [
    dict(model="tiny-llava", attn="eager", precision="bf16"),
    dict(model="tiny-llama", attn="eager", precision="fp32", grad_ckpt=True, micro_batch=1,
         seq_len=128),
    dict(model="tiny-llava-siglip", precision="bf16-mixed", micro_batch=1, seq_len=128),
    dict(model="tiny-llava-siglip", precision="bf16", train="lora", grad_ckpt=True,
         micro_batch=4, seq_len=96),
    dict(model="tiny-llava-next", precision="bf16", image_size=45, seq_len=256),
    dict(model="tiny-llava-next", precision="fp32", train="llm+projector", grad_ckpt=True,
         image_size=60, seq_len=256),
    dict(model="tiny-llava", precision="bf16-master"),
    dict(model="tiny-llava", precision="bf16", optimizer="adamw-8bit"),
    dict(model="tiny-llava", precision="bf16", optimizer="adafactor"),
    dict(model="tiny-llama", precision="fp32", optimizer="lion", seq_len=200),
    dict(model="tiny-llama", precision="bf16", optimizer="sgd-momentum", micro_batch=3),
    # PEFT adapter configs: DoRA, modules_to_save (a trainable copy), both
    dict(model="tiny-llama", precision="bf16", train="lora",
         lora=LoraSpec(r=4, targets=("q_proj", "v_proj"), use_dora=True)),
    dict(model="tiny-llava", precision="bf16-mixed", train="lora", lora=LoraSpec(r=4, use_dora=True)),
    dict(model="tiny-llama", precision="fp32", train="lora",
         lora=LoraSpec(r=4, targets=("q_proj",), modules_to_save=("lm_head",))),
    dict(model="tiny-llava", precision="bf16", train="lora",
         lora=LoraSpec(r=4, use_dora=True, modules_to_save=("embed_tokens",))),
    dict(model="tiny-llava", precision="bf16", train="lora", grad_ckpt=True,
         lora=LoraSpec(r=4, targets=("q_proj",), modules_to_save=("embed_tokens",))),
    # bf16 weights under bf16 autocast: fp32 adapters cast, fp32 LayerNorm outputs
    dict(model="tiny-llama", precision="bf16-autocast", train="lora", grad_ckpt=True),
    dict(model="tiny-llava", precision="bf16-autocast", train="lora"),
    dict(model="tiny-llava", precision="bf16-autocast", train="full", attn="eager"),
    dict(model="tiny-llava-siglip", precision="bf16-autocast", train="lora", grad_ckpt=True,
         micro_batch=4, seq_len=96),
    dict(model="tiny-llama", precision="bf16-autocast", train="lora", quantize="nf4",
         kbit_prep=False, grad_ckpt=True),  # LLaMA-Factory's QLoRA
]
FAST = GRID[::3] + GRID[1::9] + EXTRA  # 36 + 12 + 11 configs; every level of every factor
SLOW = [g for g in GRID if g not in FAST]


def _id(kw: dict) -> str:
    return "-".join(str(v) for v in kw.values())


def _check(kw: dict) -> None:
    spec = TrainingSpec(**{"micro_batch": 2, "seq_len": 64, **kw})
    a, tr = analytic(spec), trace.estimate(spec)
    assert a.params_total == tr.params_total
    assert a.params_trainable == tr.params_trainable
    assert a.breakdown["param"] == tr.breakdown["param"]
    am, tm = {m.name: m for m in a.modules}, {m.name: m for m in tr.modules}
    for name in tm:
        assert am[name].optimizer == tm[name].optimizer, name
        assert am[name].grad == tm[name].grad, name
    rel = (a.peak.allocated_bytes - tr.peak.allocated_bytes) / tr.peak.allocated_bytes
    assert abs(rel) <= TOL
    ta = a.peak.allocated_bytes - a.breakdown["workspace"]
    tt = tr.peak.allocated_bytes - tr.breakdown["workspace"]
    assert abs(ta - tt) / tt <= TOL, f"tensor peak {ta} vs trace {tt}"


@pytest.mark.parametrize("kw", FAST, ids=_id)
def test_analytic_matches_trace(kw):
    _check(kw)


@pytest.mark.slow
@pytest.mark.parametrize("kw", SLOW, ids=_id)
def test_analytic_matches_trace_rest_of_grid(kw):
    _check(kw)


def test_tied_embeddings_match_trace(tmp_path):
    """A tied lm_head owns no tensor: its grad is the embedding's (appearing at the head)."""
    import json

    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict("tiny-llama")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    data["tie_word_embeddings"] = True
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    _check(dict(model=str(path), precision="bf16"))
