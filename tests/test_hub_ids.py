"""Hub ids as the launchers' examples spell them name their preset by the table's rules
(`hybridmem.models.hub`), and the answers' frictions of issue #34: did-you-mean, soft warnings
for jobs that cannot run, usage errors on the first line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridmem.errors import SpecError
from hybridmem.models import hub

# ids the launchers' own examples and model cards use -> the preset of their architecture
IDS = {
    "Qwen/Qwen3-4B-Instruct-2507": "qwen3-4b",      # LLaMA-Factory examples: dated instruct
    "Qwen/Qwen3-4B-Thinking-2507": "qwen3-4b",
    "Qwen/Qwen3-VL-4B-Instruct": "qwen3-vl-4b-instruct",
    "NousResearch/Llama-3.2-1B": "llama-3.2-1b",    # axolotl examples: mirrors
    "NousResearch/Meta-Llama-3.1-8B": "llama-3.1-8b",  # Meta's older spelling of the name
    "NousResearch/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b",
    "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b",
    "unsloth/Qwen3-4B-Instruct-2507": "qwen3-4b",
    "unsloth/gemma-3-4b-it": "gemma-3-4b-it",
    "unsloth/llama-3-8b-bnb-4bit": "llama-3-8b",
    "mistralai/Mistral-Nemo-Instruct-2407": "mistral-nemo-base-2407",
    "google/gemma-3-1b-it": "gemma-3-1b-pt",
    "QWEN/qwen3-8b": "qwen3-8b",                    # the hub ignores case
}


@pytest.mark.parametrize("hub_id, preset", sorted(IDS.items()))
def test_hub_id_names_its_architectures_preset(hub_id, preset):
    assert hub.resolve(hub_id) == preset


@pytest.mark.parametrize("hub_id", [
    "Qwen/Qwen2.5-Coder-7B",       # a different tune's name: not a variant suffix
    "someone/Qwen3-4B",            # not a mirror the table names
    "meta-llama/Llama-3.2-1B-Vision",
])
def test_ids_outside_the_rules_stay_unknown(hub_id):
    with pytest.raises(SpecError, match=r"unknown hub id.*hybridmem downloads nothing"):
        hub.resolve(hub_id)


@pytest.mark.parametrize("hub_id, why", [
    ("mlx-community/Llama-3.2-1B-Instruct-4bit", "an MLX conversion"),
    ("unsloth/Qwen3-4B-Instruct-2507-GGUF", "a GGUF file"),
    ("lmstudio-community/Qwen3-4B-MLX-4bit", "an MLX conversion"),
])
def test_other_runtimes_conversions_are_refused_by_name(hub_id, why):
    with pytest.raises(SpecError, match=rf"^model='{hub_id}': {why}.*name the checkpoint it "
                                        r"was converted from"):
        hub.resolve(hub_id)


def test_every_rule_key_names_one_preset():
    """The variant rules would be ambiguous if two presets' ids reduced to one name: the
    module refuses that when it loads; here every table id reads back its own preset."""
    for hub_id, preset in hub.HUB_PRESETS.items():
        assert hub.preset_for(hub_id) == preset


def test_prequantized_upload_prices_nf4_weights():
    """unsloth's `-bnb-4bit` uploads are stored as bitsandbytes NF4 (their config.json's
    quantization_config): the job is priced with 4-bit weights without a --quantize."""
    from hybridmem.intake.resolve import resolve_cli

    resolved = resolve_cli(model="unsloth/llama-3-8b-bnb-4bit", train="lora")
    spec = resolved.spec
    assert spec.model == "llama-3-8b" and spec.quantize == "nf4"
    assert "quantization_config" in resolved.sources["quantize"]
    assert resolve_cli(model="unsloth/Meta-Llama-3-8B", train="lora").spec.quantize == "none"
    assert hub.prequantized("unsloth/llama-3-8b-bnb-4bit")["bnb_4bit_quant_type"] == "nf4"


def test_did_you_mean():
    from hybridmem.models.loader import load_config_dict

    with pytest.raises(SpecError, match=r"^model='llava-1.5-7bb': unknown preset, did you mean "
                                        r"'llava-1.5-7b'\? \(hybridmem models lists them all\)$"):
        load_config_dict("llava-1.5-7bb")
    with pytest.raises(SpecError, match=r"did you mean 'meta-llama/Llama-3.2-1B-Instruct'\?"):
        hub.resolve("meta-llama/Llama-3.2-1B-Instrct")


# --- soft warnings and first-line errors ---------------------------------------------------

def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", *argv],
                          capture_output=True, text=True)


def test_jobs_past_what_the_model_runs_answer_with_warnings_first():
    import json

    from hybridmem.answer import answer, resolve_job

    # within the schema's bounds (seq_len <= 2**24), yet past the window and every GPU
    resolved, warnings = resolve_job({"model": "llama-3.2-1b", "seq_len": 16_000_000})
    found = answer(resolved, warnings, None)
    got = found.to_dict()["job"]["warnings"]
    # llama-3.2-1b's config.json: max_position_embeddings 131072
    assert any("past llama-3.2-1b's context window (max_position_embeddings 131072)" in w
               for w in got)
    assert any("more than any GPU in the catalogue holds" in w for w in got)
    proc = _cli("--model", "llama-3.2-1b", "--micro-batch", "65536", "--json")
    assert proc.returncode == 0
    assert proc.stderr.startswith("warning: micro_batch=65536 x seq_len=2048")
    assert json.loads(proc.stdout)["job"]["warnings"]
    ok, _ = resolve_job({"model": "llama-3.2-1b"})
    assert answer(ok, [], None).result.job["warnings"] == []


def test_usage_errors_are_on_the_first_line():
    proc = _cli("--model", "llama-3.2-1b", "--seq-len", "abc")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith("error: Invalid value for '--seq-len'")


def test_the_too_big_warning_does_not_suggest_a_search_the_answer_ran():
    """The micro-batch search already ran: the warning points at its answer, not at the flag."""
    from hybridmem import plausible
    from hybridmem.job.spec import TrainingSpec

    spec = TrainingSpec(model="llama-3.2-1b", micro_batch=8)
    huge = 10**15  # bytes: more than any catalogue GPU (hybridmem/gpus.py, the largest about 140 GiB)
    (asked,) = [w for w in plausible.warnings(spec, huge) if "catalogue" in w]
    (ran,) = [w for w in plausible.warnings(spec, huge, searched=True) if "catalogue" in w]
    assert "--find-max-batch" in asked and "--find-max-batch" not in ran
    assert "the micro-batch search below says what fits" in ran
