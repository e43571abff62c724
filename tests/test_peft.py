"""PEFT adapter configs (`--peft-config`): DoRA and modules_to_save in the analytic graph, any
other method through the trace tier (fake tensors == a real CPU run), and the CLI's errors.

Reference counts come from PEFT itself on the meta device, the reference bytes from a real CPU
run of the same loop (`tests/test_trace.py::real_cpu_peak`), never from the code under test.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from hybridmem import TrainingSpec
from hybridmem.adapters import spec_fields
from hybridmem.errors import SpecError
from hybridmem.models import build_graph, load_config
from hybridmem.job.spec import LoraSpec

from test_models import _meta_model
from test_trace import real_cpu_peak

trace = pytest.importorskip("hybridmem.trace")
from hybridmem.trace import runner  # noqa: E402

DORA = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
        "use_dora": True}
METHODS = {
    "IA3": {"peft_type": "IA3", "target_modules": ["k_proj", "v_proj", "down_proj"],
            "feedforward_modules": ["down_proj"]},
    "PROMPT_TUNING": {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 10,
                      "task_type": "CAUSAL_LM"},
    "OFT": {"peft_type": "OFT", "r": 4, "oft_block_size": 0, "target_modules": ["q_proj", "v_proj"]},
    "LOHA": {"peft_type": "LOHA", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
}


def _peft_meta(model: str, cfg):
    import peft

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(_meta_model(load_config(model)), cfg)


def _counts(model) -> tuple[int, int]:
    params = {id(p): p for _, p in model.named_parameters(remove_duplicate=True)}.values()
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@pytest.mark.parametrize("model, lora", [
    ("tiny-llava", LoraSpec(r=4, targets=("q_proj", "down_proj"), use_dora=True)),
    ("tiny-llama", LoraSpec(r=4, targets=("q_proj",), modules_to_save=("lm_head",))),
    ("tiny-llava", LoraSpec(r=4, use_dora=True, modules_to_save=("embed_tokens",))),
    # tied embeddings: the lm_head copy is a new (V x h) weight (3.2B params on meta: no memory)
    ("llama-3.2-3b", LoraSpec(r=8, targets=("v_proj",), modules_to_save=("lm_head",))),
])
def test_dora_and_modules_to_save_counts_match_peft(model, lora):
    import peft

    spec = TrainingSpec(model=model, micro_batch=1, seq_len=256, train="lora", lora=lora)
    g = build_graph(spec)
    cfg = peft.LoraConfig(r=lora.r, target_modules=r"^(?!.*vision_tower).*\.("
                          + "|".join(lora.targets) + r")$", use_dora=lora.use_dora,
                          modules_to_save=list(lora.modules_to_save) or None)
    total, trainable = _counts(_peft_meta(model, cfg))
    got_lora = sum(m.num_lora_params + m.num_copy_params for m in g.modules)
    assert g.num_params + got_lora == total
    assert got_lora == trainable


def test_dora_magnitude_is_one_fp32_vector_per_adapted_linear():
    g = build_graph(TrainingSpec(model="tiny-llama", train="lora", seq_len=64,
                                 lora=LoraSpec(r=4, targets=("v_proj",), use_dora=True)))
    mags = [p for m in g.modules for layer in m.layers for p in layer.lora
            if "magnitude" in p.name]
    # tiny-llama: 2 layers, v_proj out = kv_heads x head_dim
    cfg = load_config("tiny-llama")
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert [(p.shape, p.itemsize) for p in mags] == [((kv,), 4)] * cfg.num_hidden_layers


# --- trace tier == a real CPU run --------------------------------------------------------

def _spec(model: str, cfg: dict, **kw) -> TrainingSpec:
    return TrainingSpec(**{"model": model, "micro_batch": 2, "seq_len": 64, "precision": "bf16",
                           **spec_fields(cfg), **kw})


@pytest.mark.compat
@pytest.mark.parametrize("model, cfg, kw", [
    ("tiny-llama", DORA, {}),
    ("tiny-llava", DORA, {"precision": "fp32"}),
    ("tiny-llama", METHODS["IA3"], {}),
    ("tiny-llama", METHODS["PROMPT_TUNING"], {}),
    ("tiny-llama", METHODS["OFT"], {}),
    ("tiny-llama", METHODS["LOHA"], {}),
], ids=["dora-llama", "dora-llava-fp32", "ia3", "prompt", "oft", "loha"])
def test_fake_trace_equals_real_cpu_run(model, cfg, kw):
    spec = _spec(model, cfg, **kw)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="fake")
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.parametrize("name", ["IA3", "PROMPT_TUNING", "OFT"])
def test_meta_backend_equals_fake_for_peft_methods(name):
    spec = _spec("tiny-llama", METHODS[name])
    peaks = [int(runner.trace(spec, load_config(spec.model), backend=b)[0].live_curve().max())
             for b in ("meta", "fake")]
    assert peaks[0] == peaks[1]


@pytest.mark.parametrize("name", ["IA3", "PROMPT_TUNING", "OFT"])
def test_trace_trainable_params_are_peft_s(name):
    import peft

    spec = _spec("tiny-llama", METHODS[name])
    pred = trace.estimate(spec)
    want = _counts(_peft_meta("tiny-llama", peft.PeftConfig.from_peft_type(**METHODS[name])))
    assert (pred.params_total, pred.params_trainable) == want


def test_prompt_tuning_traces_the_longer_sequence():
    # PEFT prepends num_virtual_tokens to the embeddings (peft_model.py): the fp32 logits the
    # loss upcasts are b x (s + virtual) x vocab x 4 bytes, and none of b x s x vocab exist
    spec = _spec("tiny-llama", METHODS["PROMPT_TUNING"])
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    vocab = load_config("tiny-llama").vocab_size
    sizes = {s.nbytes for s in tracker.storages}
    assert 2 * (64 + 10) * vocab * 4 in sizes
    assert 2 * 64 * vocab * 4 not in sizes


# --- boundary ------------------------------------------------------------------------------

def test_analytic_tier_refuses_other_methods_with_one_line():
    from hybridmem.analytic import estimate as analytic
    from hybridmem.predict import predict

    spec = _spec("tiny-llama", METHODS["IA3"])
    with pytest.raises(SpecError, match=r"^train='peft': IA3 adapters have no closed form here$"):
        analytic(spec)
    with pytest.raises(SpecError, match=r"^train='peft': IA3 .*; use --method trace$"):
        predict(spec, method="analytic")


def test_unknown_peft_type_names_the_method():
    spec = _spec("tiny-llama", {"peft_type": "NOPE_TUNING", "r": 2})
    with pytest.raises(SpecError, match=r"^peft_config.peft_type='NOPE_TUNING'"):
        trace.estimate(spec)


def test_method_peft_cannot_build_names_the_method():
    spec = _spec("tiny-llama", {"peft_type": "IA3", "target_modules": ["no_such_proj"],
                                "feedforward_modules": []})
    with pytest.raises(SpecError, match=r"^peft_config='IA3': peft cannot build") as err:
        trace.estimate(spec)
    assert "\n" not in str(err.value)
