"""Families without closed forms: priced by the trace tier, built by transformers.
(qwen3, phi3, ... have closed forms now, docs/families.md; they stay here as checks of the
trace tier on their transformers code; gpt2 is the CLI's trace-only example.)

Each test writes a tiny config of a family with `AutoConfig.for_model(...).to_dict()` (no
network) and checks the trace tier against independent counts of the model built on the meta
device, a real CPU run's peak byte for byte, and the CLI's tier choice and one-line errors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hybridmem.cli import main
from hybridmem.errors import SpecError, UnsupportedModelError
from hybridmem.models import load_config
from hybridmem.models.loader import is_analytic
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.trace import estimate, runner
from test_trace import real_cpu_peak

# small enough that a family traces in well under a second
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, head_dim=16, max_position_embeddings=256)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              patch_size=14)
FAMILIES: dict[str, dict] = {
    "qwen3": TEXT,
    "phi3": dict(TEXT, pad_token_id=0),  # fused qkv_proj / gate_up_proj
    "mixtral": dict(TEXT, num_local_experts=4, num_experts_per_tok=2),  # MoE, fused experts
    "gemma2": TEXT,  # eager attention only (its transformers code refuses SDPA)
    # bos / eos inside the tiny vocabulary (GPT-2's 50256 makes transformers warn on stderr)
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=256,
                 bos_token_id=0, eos_token_id=0),  # Conv1D
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=256, word_embed_proj_dim=64, max_position_embeddings=256),
    "qwen2_vl": dict(text_config=dict(TEXT, rope_scaling={"type": "mrope",
                                                          "mrope_section": [2, 3, 3]}),
                     vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4,
                                        mlp_ratio=2, patch_size=14, spatial_merge_size=2)),
    "paligemma": dict(text_config=dict(TEXT, model_type="gemma"), projection_dim=64,
                      vision_config=dict(VISION, image_size=28)),
    "idefics3": dict(text_config=dict(TEXT, model_type="llama"), scale_factor=2,
                     vision_config=dict(VISION, image_size=56)),
    "smolvlm": dict(text_config=dict(TEXT, model_type="llama"), scale_factor=2,
                    vision_config=dict(VISION, image_size=56)),
}
# What each family needs to run its training step: Gemma 2 has no SDPA path; transformers'
# `torch._grouped_mm` experts (Mixtral) take bf16 weights only (the meta kernel mirrors
# CUDA's check in aten/src/ATen/native/cuda/Blas.cpp).
RUNS: dict[str, dict] = {"gemma2": dict(attn="eager"), "mixtral": dict(precision="bf16"),
                         # has an image rule now (tests/test_vlm_families.py): text-only here
                         "qwen2_vl": dict(images_per_sample=0),
                         "idefics3": dict(images_per_sample=0),
                         "smolvlm": dict(images_per_sample=0)}
# Module-name prefixes of each VLM part, read off the families' transformers module trees
# (written out here, not derived from `part_of`, so a wrong fragment table fails).
VLM_PARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen2_vl": {"vision_tower": ("model.visual.",), "multi_modal_projector":
                 ("model.visual.merger.",)},
    "paligemma": {"vision_tower": ("model.vision_tower.",),
                  "multi_modal_projector": ("model.multi_modal_projector.",)},
    "idefics3": {"vision_tower": ("model.vision_model.",),
                 "multi_modal_projector": ("model.connector.",)},
    "smolvlm": {"vision_tower": ("model.vision_model.",),
                "multi_modal_projector": ("model.connector.",)},
}


def write_config(tmp_path, family: str) -> str:
    from transformers import AutoConfig

    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(AutoConfig.for_model(family, **FAMILIES[family]).to_dict()))
    return str(path)


def meta_model(path: str):
    """The family's model as transformers builds it on the meta device (the reference)."""
    import transformers
    from transformers import AutoConfig

    data = json.loads(open(path).read())
    cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    names = ("AutoModelForImageTextToText", "AutoModelForCausalLM")
    auto = next(getattr(transformers, n) for n in names
                if getattr(transformers, n)._model_mapping.get(type(cfg), None) is not None)
    with torch.device("meta"):
        model = auto.from_config(cfg)
    model.tie_weights()
    return model


def part_counts(model, family: str) -> dict[str, int]:
    """Parameters per part by the written-out prefixes (the longest prefix wins)."""
    prefixes = [(p, part) for part, ps in VLM_PARTS.get(family, {}).items() for p in ps]
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        hits = [(len(pre), part) for pre, part in prefixes if name.startswith(pre)]
        part = max(hits)[1] if hits else ("lm_head" if name.startswith("lm_head") else
                                          "language_model")
        out[part] = out.get(part, 0) + p.numel()
    return out


def spec_of(path: str, family: str, **kw) -> TrainingSpec:
    return TrainingSpec(**{"model": path, "micro_batch": 2, "seq_len": 32, **RUNS.get(family, {}),
                           **kw})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_counts_equal_the_meta_model(family, tmp_path):
    path = write_config(tmp_path, family)
    ref = meta_model(path)
    total = sum(p.numel() for p in ref.parameters())
    pred = estimate(spec_of(path, family))
    assert (pred.params_total, pred.params_trainable) == (total, total)
    assert {m.name: m.params for m in pred.modules} == part_counts(ref, family)
    assert pred.peak.allocated_bytes > 2 * total  # weights + grads at least (fp32 / bf16)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gpt2", "mixtral"])
def test_lora_counts_equal_peft_all_linear_on_the_meta_model(family, tmp_path):
    """The default targets mean "all LLM linear layers": PEFT's own `all-linear` on the meta
    model is the reference (Phi-3's fused qkv_proj, GPT-2's Conv1D, Mixtral's router)."""
    import peft

    path = write_config(tmp_path, family)
    ref = peft.get_peft_model(meta_model(path), peft.LoraConfig(r=4, target_modules="all-linear"))
    total = sum(p.numel() for p in ref.parameters())
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    pred = estimate(spec_of(path, family, train="lora", lora=LoraSpec(r=4)))
    assert (pred.params_total, pred.params_trainable) == (total, trainable)
    if not is_analytic(family):  # the analytic families' default targets are their own names
        assert any(n.startswith("lora: adapters on ") for n in pred.notes)


@pytest.mark.parametrize("family", sorted(VLM_PARTS))
@pytest.mark.parametrize("train", ["llm+projector", "lora"])
def test_vlm_parts_freeze_by_train_mode(family, train, tmp_path):
    path = write_config(tmp_path, family)
    parts = part_counts(meta_model(path), family)
    trains = {"llm+projector": {"multi_modal_projector", "language_model", "lm_head"},
              "lora": set()}[train]
    pred = estimate(spec_of(path, family, train=train))
    rows = {m.name: m for m in pred.modules}
    for part, n in parts.items():
        if train == "lora" and part == "language_model":  # the adapters live there
            assert rows[part].params > n and 0 < rows[part].trainable_params < n
        else:
            assert (rows[part].params, rows[part].trainable_params) == (
                n, n if part in trains else 0)
    if family == "paligemma":  # qwen2_vl, idefics3 have an image rule: text-only by choice
        assert any("text-only batches" in n for n in pred.notes)


@pytest.mark.parametrize("family, kw", [
    ("qwen3", dict(precision="fp32")),
    ("phi3", dict(precision="fp32", train="lora", lora=LoraSpec(r=4), grad_ckpt=True)),
    ("qwen2_vl", dict(precision="fp32", train="llm+projector")),
])
def test_fake_trace_equals_a_real_cpu_run(family, kw, tmp_path):
    spec = spec_of(write_config(tmp_path, family), family, **kw)
    tracker, _ = runner.trace(spec, load_config(spec.model))
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


def test_vlm_without_image_rule_refuses_images(tmp_path):
    path = write_config(tmp_path, "paligemma")
    with pytest.raises(SpecError, match=r"images_per_sample=1: no image-token rule for "
                                        r"model_type='paligemma'"):
        estimate(spec_of(path, "paligemma", images_per_sample=1))


def test_text_only_vlm_refuses_projector_only_training(tmp_path):
    """On a text-only batch the projector never runs: nothing would reach its grads."""
    path = write_config(tmp_path, "paligemma")
    with pytest.raises(SpecError, match=r"train='projector': the projector runs no forward"):
        estimate(spec_of(path, "paligemma", train="projector"))


def test_decoder_refuses_vlm_train_modes(tmp_path):
    path = write_config(tmp_path, "qwen3")
    with pytest.raises(SpecError, match=r"train='projector'.*no vision tower or projector"):
        estimate(spec_of(path, "qwen3", train="projector"))


def test_model_its_code_cannot_run_is_one_line(tmp_path, monkeypatch):
    """Mixtral's grouped-mm experts in fp32: the meta kernel's refusal (bf16 only), one line;
    with the tier's own rule (`trace.scope`) off, the run itself refuses the same way."""
    from hybridmem.trace import scope

    path = write_config(tmp_path, "mixtral")
    with pytest.raises(SpecError, match=r"^precision='fp32': mixtral's grouped-mm experts run "
                                        r"in bf16 only under fake tensors \(valid: bf16, "
                                        r"bf16-master, bf16-autocast\)$"):
        estimate(spec_of(path, "mixtral", precision="fp32"))
    monkeypatch.setattr(scope, "refusal", lambda spec: None)
    with pytest.raises(UnsupportedModelError, match=r"cannot run under fake tensors "
                                                    r"\(RuntimeError: Expected inputs of BF16") as err:
        estimate(spec_of(path, "mixtral", precision="fp32"))
    assert "\n" not in str(err.value) and "--method" not in str(err.value)


# --- validation and the CLI ----------------------------------------------------------------

def test_unknown_model_type_names_the_choices(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no_such_family"}))
    with pytest.raises(SpecError) as err:
        load_config(str(path))
    # the families with closed forms (hybridmem/families/), then the trace tier's clause
    message = str(err.value)
    assert message.startswith("model_type='no_such_family' is not valid (valid: ")
    assert message.endswith(", any transformers causal-LM / image-text-to-text model_type with "
                            "--method trace)")
    for family in ("llava", "llava_next", "qwen2_vl", "idefics3", "llama", "qwen3_moe"):
        assert f" {family}," in message


def test_cli_picks_the_trace_tier_for_a_generic_family(tmp_path, capsys):
    path = write_config(tmp_path, "gpt2")
    assert main(["predict", "--model", path, "--seq-len", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "trace"
    assert ("method: trace chosen because the analytic tier refuses model_type='gpt2': this "
            "family has no closed forms here (pass --method to override)") in out["notes"]


def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", *argv],
                          capture_output=True, text=True)


@pytest.mark.parametrize("family, argv, message", [
    ("gpt2", ["--method", "analytic"], "error: model_type='gpt2': this family has no closed "
     "forms here; use --method trace"),
    # both tiers read the installed transformers' class (families/attention.py)
    ("gemma2", ["--attn", "sdpa"], "error: attn='sdpa': transformers' gemma2 code "
     "does not support it (Gemma2ForCausalLM._supports_sdpa is False in the installed "
     "transformers) (valid: eager, flash_attention_2)"),
    ("gemma2", ["--attn", "sdpa", "--method", "trace"], "error: attn='sdpa': transformers' "
     "gemma2 code does not support it (Gemma2ForCausalLM._supports_sdpa is False"),
    # non-bf16 MoE: each tier's rule refuses it (analytic.scope, trace.scope), and each
    # refusal says that no tier prices it
    ("mixtral", ["--precision", "fp32", "--method", "trace"], "error: precision='fp32': "
     "mixtral's grouped-mm experts run in bf16 only under fake tensors; no tier prices this "
     "job (the analytic tier: precision='fp32': mixtral's grouped-mm experts are priced in "
     "bf16) (valid: bf16, bf16-master, bf16-autocast)"),
    ("mixtral", ["--precision", "fp32", "--method", "analytic"], "error: precision='fp32': "
     "mixtral's grouped-mm experts are priced in bf16; no tier prices this job (the trace "
     "tier: precision='fp32': mixtral's grouped-mm experts run in bf16 only under fake "
     "tensors) (valid: bf16)"),
    ("mixtral", ["--precision", "fp32"], "error: precision='fp32': mixtral's grouped-mm "
     "experts are priced in bf16; no tier prices this job (the trace tier: "),
    # the valid choices: every family with closed forms (test_unknown_model_type_names_the_choices)
    (None, [], "error: model_type='no_such_family' is not valid (valid: "),
])
def test_cli_one_line_exit_2(family, argv, message, tmp_path):
    """A fresh process, real tiers: exit 2 and exactly one line on stderr (no torch log)."""
    if family is None:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"model_type": "no_such_family"}))
        path = str(path)
    else:
        path = write_config(tmp_path, family)
    proc = _cli("--model", path, "--seq-len", "32", *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(message.format(path=path)), proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1


def test_hybrid_answers_with_the_trace_tier_where_no_analytic_base_exists(tmp_path):
    """The residual models correct the analytic tier; without one the trace tier answers."""
    path = write_config(tmp_path, "gpt2")
    proc = _cli("--model", path, "--seq-len", "32", "--method", "hybrid", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["method"] == "trace" and out["fallback"] == "trace"
    assert out["method_reason"].startswith("the analytic tier refuses model_type='gpt2': ")
    assert any(n.startswith("hybrid: the analytic tier refuses model_type='gpt2'")
               for n in out["notes"])
    trace = json.loads(_cli("--model", path, "--seq-len", "32", "--method", "trace",
                            "--json").stdout)
    assert out["peak"] == trace["peak"]
