"""Trace tier: fake run == real CPU run to the byte, category sums, LoRA, LLaVA-NeXT, errors."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridmem.errors import SpecError, UnsupportedModelError
from hybridmem.models import load_config
from hybridmem.predict import predict
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.trace import estimate, run_trace, runner, save_timeline

BLOCK = 512  # CUDACachingAllocator kMinBlockSize, restated here so the test does not import it


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


class DataPtrCounter(TorchDispatchMode):
    """Independent of the tracker: live bytes keyed by real storage address, peak after each op."""

    def __init__(self, start: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        for t in start:
            self._add(t.untyped_storage())

    def _add(self, st) -> None:
        ptr = st.data_ptr()
        if st.nbytes() == 0 or ptr in self.live:
            return
        self.live[ptr] = rounded(st.nbytes())
        self.current += self.live[ptr]
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out


def real_cpu_peak(spec: TrainingSpec) -> int:
    """Peak of the same training loop on real CPU tensors, counted by `DataPtrCounter`."""
    from hybridmem.trace import corrections
    from hybridmem.trace.tracker import StorageTracker

    torch.manual_seed(0)
    with corrections.patched_model_checks():
        job = runner.prepare(spec, load_config(spec.model))
        start = [*job.model.parameters(), *job.model.buffers(), *job.masters,
                 *(t for t in job.batch.values() if isinstance(t, torch.Tensor))]
        counter = DataPtrCounter(start)
        with StorageTracker() as labels, counter:  # the runner needs a tracker for its labels
            runner.train(job, spec, labels, runner.ITERATIONS)
    return counter.peak


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llava", "micro_batch": 2, "seq_len": 64, **kw})


@pytest.mark.compat
@pytest.mark.parametrize("kw", [
    dict(precision="fp32", attn="eager", optimizer="adamw"),
    dict(precision="bf16-mixed", attn="sdpa", optimizer="adamw", train="llm+projector",
         grad_ckpt=True),
    dict(precision="bf16", attn="sdpa", optimizer="sgd-momentum"),
    # bf16 weights under autocast: CUDA's fp32 norms cast the bf16 weights, in recomputes too
    dict(precision="bf16-autocast", attn="sdpa", optimizer="adamw", train="llm+projector",
         grad_ckpt=True),
    dict(precision="bf16-autocast", attn="eager", optimizer="adamw", train="lora"),
])
def test_fake_peak_equals_real_cpu_run(kw):
    spec = tiny(**kw)
    tracker, _ = runner.trace(spec, load_config(spec.model))
    fake_peak = int(tracker.live_curve(device_only=False).max())  # host scalars are real here
    assert fake_peak == real_cpu_peak(spec)


@pytest.mark.compat
def test_meta_peak_equals_real_cpu_run():
    # the default backend, fp32 (no autocast: CPU and emulated CUDA lists cannot differ)
    spec = tiny(precision="fp32", grad_ckpt=True, train="llm+projector")
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


def test_step_scalars_left_off_the_device():
    # torch/optim/adamw.py: non-fused, non-capturable `step` is a CPU scalar, one per param.
    spec = tiny(precision="fp32")
    tracker, job = runner.trace(spec, load_config(spec.model))
    host = [s for s in tracker.storages if s.category == "host"]
    assert len(host) == len(job.optimizer.state) > 0
    assert all(s.nbytes == 4 for s in host)  # float32 scalar (`_get_scalar_dtype`)


def _live_by_category(tracker, index: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in tracker.live_at(index):
        out[s.category] = out.get(s.category, 0) + rounded(s.nbytes)
    return out


@pytest.mark.parametrize("precision,optimizer,states", [
    ("fp32", "adamw", 2), ("bf16", "adamw", 2), ("fp32", "sgd-momentum", 1), ("fp32", "sgd", 0),
])
def test_param_grad_optimizer_equal_direct_sums(precision, optimizer, states):
    spec = tiny(precision=precision, optimizer=optimizer)
    tracker, job = runner.trace(spec, load_config(spec.model))
    # the last optimizer mark: after the 2nd backward, before the 2nd step
    at = [i for i, p, it in tracker.marks if p == "optimizer"][-1] - 1
    live = _live_by_category(tracker, at)
    params = list(job.model.parameters()) + list(job.model.buffers())
    assert live["param"] == sum(rounded(p.numel() * p.element_size()) for p in params)
    # every param the optimizer holds state for got a grad (the unused last CLIP layer did not)
    stepped = [p for _, p in job.trainable if p in job.optimizer.state] if states else [
        p for _, p in job.trainable if "encoder.layers.2" not in _name(job, p)
        and "post_layernorm" not in _name(job, p)]
    assert live["grad"] == sum(rounded(p.numel() * p.element_size()) for p in stepped)
    assert live.get("optimizer", 0) == states * sum(rounded(p.numel() * p.element_size())
                                                    for p in job.optimizer.state)


def _name(job, p) -> str:
    return next(n for n, q in job.trainable if q is p)


def test_frozen_last_clip_layer_gets_no_state():
    spec = tiny(precision="fp32", train="full")
    _, job = runner.trace(spec, load_config(spec.model))
    stateless = {n for n, p in job.trainable if p not in job.optimizer.state}
    assert stateless and all("vision_tower" in n for n in stateless)
    assert any("post_layernorm" in n for n in stateless)


def test_lora_trace_trains_only_adapters():
    spec = tiny(precision="bf16", train="lora", lora=LoraSpec(r=4), grad_ckpt=True)
    tracker, job = runner.trace(spec, load_config(spec.model))
    names = [n for n, _ in job.trainable]
    assert names and all("lora_" in n for n in names)
    assert not any("vision_tower" in n for n in names)
    # 2 layers x 7 targets x (r*in + out*r), tiny-llava text dims from the preset
    h, inter, kv = 64, 128, 2 * 16  # hidden, intermediate, kv heads * head_dim
    per_layer = sum(4 * (i + o) for i, o in [(h, h), (h, kv), (h, kv), (h, h), (h, inter),
                                              (h, inter), (inter, h)])
    assert sum(p.numel() for _, p in job.trainable) == 2 * per_layer
    assert all(p.dtype == torch.float32 for _, p in job.trainable)  # PEFT autocast_adapter_dtype
    assert len(job.optimizer.state) == len(names)


@pytest.fixture
def tiny_next(tmp_path):
    """A tiny LLaVA-NeXT (anyres) config derived from the tiny-llava preset."""
    from hybridmem.models.loader import load_config_dict

    cfg = load_config_dict("tiny-llava")[1]
    cfg.pop("_source")
    cfg.update(model_type="llava_next", architectures=["LlavaNextForConditionalGeneration"],
               image_grid_pinpoints=[[30, 60], [60, 30], [60, 60]])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_llava_next_trace_matches_graph_image_tokens(tiny_next):
    from hybridmem.models.build import build_graph

    spec = TrainingSpec(model=tiny_next, micro_batch=2, seq_len=160, image_size=60,
                        precision="bf16-mixed", train="llm+projector")
    result = run_trace(spec)
    assert result.peak_allocated > 0 and result.peak_iteration in (0, 1)
    graph = build_graph(spec)
    _, job = runner.trace(spec, load_config(spec.model), iterations=1)
    # tokens asked of the model itself (features after anyres packing) == the parser's count
    assert job.image_tokens == graph.image_tokens > 0
    assert job.batch["pixel_values"].shape[1] > 1  # anyres: base image + grid crops


def test_estimate_schema_and_timeline(tmp_path):
    pred = estimate(tiny(precision="bf16-mixed"), timeline=tmp_path / "t.json")
    d = pred.to_dict()
    assert sum(d["breakdown"].values()) == d["peak"]["device_bytes"]
    assert d["breakdown"]["workspace"] == 2 * 32 * 2**20  # CublasHandlePool.cpp, Hopper
    assert d["peak"]["allocated_bytes"] <= d["peak"]["reserved_bytes"]
    assert {m["name"] for m in d["modules"]} == {"vision_tower", "multi_modal_projector",
                                                  "language_model", "lm_head"}
    assert any("known limitation" in n for n in d["notes"])
    tl = json.loads((tmp_path / "t.json").read_text())
    assert max(tl["allocated"]) == d["peak"]["allocated_bytes"]
    assert [p["phase"] for p in tl["phases"][:3]] == ["forward", "backward", "optimizer"]


def test_timeline_png(tmp_path):
    result = run_trace(tiny(precision="fp32", seq_len=32))
    path = save_timeline(result, tmp_path / "t.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SpecError, match="timeline"):
        save_timeline(result, tmp_path / "t.txt")


@pytest.mark.parametrize("kw,match", [
    (dict(model="no-such-model"), "unknown preset"),
    (dict(seq_len=8), "seq_len=8"),
    (dict(images_per_sample=1, model="llama-3.2-3b"), "images_per_sample"),
    (dict(train="projector", model="llama-3.2-3b"), "train='projector'"),
])
def test_bad_input_same_errors_as_analytic(kw, match):
    from hybridmem.models.build import build_graph

    spec = tiny(**kw)
    with pytest.raises(SpecError, match=match) as ours:
        estimate(spec)
    with pytest.raises(SpecError) as theirs:
        build_graph(spec)
    assert str(ours.value) == str(theirs.value)


def test_model_code_that_cannot_run_fake_says_so(monkeypatch):
    def broken(job, spec):
        raise NotImplementedError("aten::nonzero has no fake implementation")

    monkeypatch.setattr(runner, "_forward", broken)
    with pytest.raises(UnsupportedModelError, match=r"fake tensors.*has no fake implementation\)$"):
        estimate(tiny())
    # the way out is the chooser's (`predict.no_tier`): a tier whose rule prices the job
    with pytest.raises(UnsupportedModelError, match=r"fake tensors.*; use --method analytic$"):
        predict(tiny(), method="trace")


def test_bf16_master_steps_every_trained_tensor():
    # fp32 LoRA adapters are their own master copy; bf16 base params get fp32 masters
    for train in ("lora", "full"):
        spec = tiny(precision="bf16-master", train=train, optimizer="adamw")
        tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
        with_grad = [p for _, p in job.trainable if id(p) in job.grad_bytes]
        assert len(job.optimizer.state) == len(with_grad) > 0
        assert all(s.dtype == torch.float32 for st in job.optimizer.state.values()
                   for k, s in st.items() if k != "step")


def test_tied_embeddings_stay_tied(tmp_path):
    # Llama-3.2-3B ties lm_head to embed_tokens: 3,212,749,824 params on the meta device
    # (docs/design.md); an untied build would have 128256 x 3072 more.
    from hybridmem.trace.model import build_model

    for backend in ("meta", "fake"):
        spec = TrainingSpec(model="llama-3.2-3b", precision="bf16")
        with runner._tensors(backend, spec):
            model = build_model(spec, load_config(spec.model))
        assert sum(p.numel() for p in model.parameters()) == 3_212_749_824
