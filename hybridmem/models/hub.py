"""Hugging Face hub ids -> shipped presets: `--model meta-llama/Llama-3.2-3B` and a launcher
config's `model_name_or_path` / `base_model` name the preset of that checkpoint.

Why: users name models by their hub id; hybridmem downloads nothing, so an id maps to the preset
that transcribes that checkpoint's config.json, and an id with no preset is a one-line error
asking for a local config.json. Each preset's `_source` names the checkpoint it transcribes; an
entry below names that checkpoint, or a sibling whose config.json has the same shape fields (an
-Instruct / -it / -Base twin: the same architecture, other token ids), said beside it.
Lookups ignore case (the hub resolves ids case-insensitively).

Beyond the table's own ids, `preset_for` reads an id as the table's rules say, and nothing
fuzzier: the same architecture's instruct / chat / base / `-hf` / dated releases
(`VARIANT_SUFFIXES`, `DATED`: `Qwen/Qwen3-4B-Instruct-2507` is Qwen3-4B's shapes), the mirrors
that re-upload the same weights under their own owner (`MIRRORS`), and unsloth's pre-quantised
`-bnb-4bit` uploads (`PREQUANTIZED`: the same weights stored as bitsandbytes NF4). Conversions
for other runtimes (`REFUSED`: MLX, GGUF) are no checkpoint a CUDA trainer loads, and are
refused by name. An id none of this names stays the one-line error asking for a config.json.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridmem.errors import SpecError

HUB_PRESETS: dict[str, str] = {
    "allenai/OLMo-2-1124-7B": "olmo-2-1124-7b",  # the checkpoint the preset's _source names
    "allenai/OLMo-2-1124-7B-Instruct": "olmo-2-1124-7b",
    # Qwen(1) is remote code: priced as the same shapes in a qwen2 config (the published
    # Qwen profiling rows' proxy, hybridmem/published/qwen_profiling.py)
    "Qwen/Qwen-1_8B": "qwen-1_8b", "Qwen/Qwen-1_8B-Chat": "qwen-1_8b",
    "Qwen/Qwen-14B": "qwen-14b", "Qwen/Qwen-14B-Chat": "qwen-14b",
    # the most fine-tuned open LLMs (instruct twins share the base's shape fields)
    "google/gemma-2-27b": "gemma-2-27b", "google/gemma-2-27b-it": "gemma-2-27b",
    "meta-llama/Llama-2-7b-hf": "llama-2-7b", "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/Llama-2-13b-hf": "llama-2-13b", "meta-llama/Llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b", "meta-llama/Llama-2-70b-chat-hf": "llama-2-70b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B": "llama-3.1-70b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.1-405B": "llama-3.1-405b",
    "meta-llama/Llama-3.1-405B-Instruct": "llama-3.1-405b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "mistralai/Mistral-7B-v0.3": "mistral-7b-v0.3",
    "mistralai/Mistral-7B-Instruct-v0.3": "mistral-7b-v0.3",
    "mistralai/Mistral-Nemo-Base-2407": "mistral-nemo-base-2407",
    "mistralai/Mistral-Nemo-Instruct-2407": "mistral-nemo-base-2407",
    "microsoft/Phi-3.5-mini-instruct": "phi-3.5-mini-instruct",
    **{f"Qwen/Qwen2.5-{size}{tail}": f"qwen2.5-{size.lower()}"
       for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B") for tail in ("", "-Instruct")},
    **{f"Qwen/Qwen3-{size}{tail}": f"qwen3-{size.lower()}"
       for size in ("1.7B", "4B", "14B", "32B") for tail in ("", "-Base")},
    **{f"HuggingFaceTB/SmolLM2-{size}{tail}": f"smollm2-{size.lower()}"
       for size in ("135M", "360M", "1.7B") for tail in ("", "-Instruct")},
    # Llama 3 (8192-token context; Llama 3.1 has the same shapes): hybridmem/families/decoders/
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b", "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    # decoders
    "google/gemma-2-2b": "gemma-2-2b",
    "google/gemma-2-2b-it": "gemma-2-2b",  # instruct twin: same shape fields
    "google/gemma-2-9b": "gemma-2-9b",
    "google/gemma-2-9b-it": "gemma-2-9b",  # the preset's _source checks the -it copy
    "google/gemma-3-1b-pt": "gemma-3-1b-pt",
    "google/gemma-3-1b-it": "gemma-3-1b-pt",  # the preset's _source checks the -it copy
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",  # instruct twin: same shape fields
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b-v0.1",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b-v0.1",  # instruct twin
    "microsoft/Phi-3-mini-4k-instruct": "phi-3-mini-4k-instruct",
    "microsoft/phi-4": "phi-4",
    "Qwen/Qwen2-7B": "qwen2-7b",
    "Qwen/Qwen2-7B-Instruct": "qwen2-7b",  # instruct twin: same shape fields
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-8B-Base": "qwen3-8b",  # the preset's _source checks the -Base copy
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    # vision-language models
    "google/gemma-3-4b-it": "gemma-3-4b-it",
    "HuggingFaceM4/Idefics3-8B-Llama3": "idefics3-8b-llama3",
    "OpenGVLab/InternVL3-1B-hf": "internvl3-1b-hf",
    "OpenGVLab/InternVL3-2B-hf": "internvl3-2b-hf",
    "OpenGVLab/InternVL3-8B-hf": "internvl3-8b-hf",
    "llava-hf/llava-1.5-7b-hf": "llava-1.5-7b",
    "llava-hf/llava-1.5-13b-hf": "llava-1.5-13b",
    "llava-hf/llava-v1.6-mistral-7b-hf": "llava-v1.6-mistral-7b",
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": "llava-onevision-qwen2-0.5b-ov-hf",
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": "llava-onevision-qwen2-7b-ov-hf",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": "mistral-small-3.1-24b-instruct-2503",
    "mistral-community/pixtral-12b": "pixtral-12b",
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2-vl-2b-instruct",
    "Qwen/Qwen2-VL-7B-Instruct": "qwen2-vl-7b-instruct",
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2.5-vl-3b-instruct",
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2.5-vl-7b-instruct",
    "Qwen/Qwen3-VL-2B-Instruct": "qwen3-vl-2b-instruct",
    "Qwen/Qwen3-VL-4B-Instruct": "qwen3-vl-4b-instruct",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3-vl-8b-instruct",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3-vl-30b-a3b-instruct",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "smolvlm-256m-instruct",
    "HuggingFaceTB/SmolVLM-500M-Instruct": "smolvlm-500m-instruct",
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": "smolvlm2-2.2b-instruct",
}
"""Hub id (as the model page spells it) -> preset name."""

# The rules `preset_for` reads an id by (module docstring), each with its source:
VARIANT_SUFFIXES: tuple[str, ...] = ("-instruct", "-chat", "-it", "-pt", "-base", "-hf",
                                     "-thinking")
"""Release variants of one architecture: Meta's `-hf` conversions and `-chat-hf` tunes, Qwen's
`-Instruct` / `-Base` / `-Thinking`, Google's `-it` / `-pt`, Mistral's `-Instruct`: each model
card names the base it was tuned from, with the same config.json shape fields (the table's own
pairs above are checked cases)."""
DATED = re.compile(r"-\d{4}$")
"""A dated re-release of the same architecture (Qwen3-4B-Instruct-2507, Mistral-Nemo-*-2407,
Mistral-Small-3.1-24B-Instruct-2503: year-month tags on the same shapes)."""
MIRRORS: tuple[str, ...] = ("nousresearch", "unsloth")
"""Owners that re-upload others' weights under the same model name (NousResearch's Llama
mirrors, unsloth's copies): read by the name alone. Meta's older `Meta-Llama-3.1-8B` spelling
of `Llama-3.1-8B` (the hub redirects it) is the same name without `Meta-`."""
PREQUANTIZED: dict[str, dict] = {
    "-unsloth-bnb-4bit": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                          "bnb_4bit_use_double_quant": True,
                          "bnb_4bit_compute_dtype": "bfloat16"},
    "-bnb-4bit": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                  "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"},
}
"""unsloth's pre-quantised uploads: the `quantization_config` their config.json carries
(unsloth/llama-3-8b-bnb-4bit: bitsandbytes 4-bit NF4, double quantisation, bf16 compute);
transformers loads them quantised whatever the trainer asks. `-unsloth-bnb-4bit` ("dynamic"
4-bit) also keeps a few sensitive linears in 16 bits (its `llm_int8_skip_modules`), priced here
as all 4-bit."""
REFUSED: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^mlx-community/|[-_]mlx(?:[-_]|$)", re.I),
     "an MLX conversion for Apple silicon, which no CUDA trainer loads"),
    (re.compile(r"gguf", re.I), "a GGUF file for llama.cpp, which no CUDA trainer loads"),
)


def _name_key(name: str) -> str:
    """The name with its variant, dated and quantisation tails and Meta's `Meta-` dropped."""
    key = name.lower()
    for tail in PREQUANTIZED:
        key = key.removesuffix(tail)
    changed = True
    while changed:
        before = key
        key = DATED.sub("", key)
        for tail in VARIANT_SUFFIXES:
            key = key.removesuffix(tail)
        changed = key != before
    return key.removeprefix("meta-")


def _keys() -> tuple[dict[str, str], dict[str, str]]:
    """(owner/name key -> preset, name key -> preset) of the table; a key that names two
    presets is refused when the module loads (the rules would be ambiguous)."""
    by_id: dict[str, str] = {}
    by_name: dict[str, str | None] = {}
    for hub_id, preset in HUB_PRESETS.items():
        owner, name = hub_id.lower().split("/")
        key = f"{owner}/{_name_key(name)}"
        if by_id.setdefault(key, preset) != preset:
            raise RuntimeError(f"{hub_id}: its variants would name {by_id[key]} and {preset}")
        name_key = _name_key(name)
        by_name[name_key] = preset if by_name.get(name_key, preset) == preset else None
    return by_id, {k: v for k, v in by_name.items() if v is not None}


_BY_LOWER: dict[str, str] = {k.lower(): v for k, v in HUB_PRESETS.items()}
_BY_KEY, _BY_NAME = _keys()

# a hub repo id: "owner/name", each part letters, digits, '-', '_', '.' (huggingface_hub
# `validate_repo_id`: no "--" or "..", not starting or ending with '-' or '.')
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(name: str) -> bool:
    """`owner/name` that is not a path on this machine (a local folder of that name wins)."""
    return (isinstance(name, str) and bool(_REPO_ID.match(name)) and ".." not in name
            and not name.endswith(".json") and not Path(name).expanduser().exists())


def preset_for(hub_id: str) -> str | None:
    """The preset of a hub id (any case) by the table and its rules, or None."""
    if not isinstance(hub_id, str) or "/" not in hub_id:
        return None
    if hub_id.lower() in _BY_LOWER:
        return _BY_LOWER[hub_id.lower()]
    owner, _, name = hub_id.lower().partition("/")
    if owner in MIRRORS:
        return _BY_NAME.get(_name_key(name))
    return _BY_KEY.get(f"{owner}/{_name_key(name)}")


def prequantized(hub_id: str) -> dict | None:
    """The `quantization_config` a pre-quantised upload's config.json carries, or None."""
    if not isinstance(hub_id, str) or preset_for(hub_id) is None:
        return None
    lower = hub_id.lower()
    return next((dict(q) for tail, q in PREQUANTIZED.items() if lower.endswith(tail)), None)


def refusal(name: str) -> str | None:
    """Why a hub id names no checkpoint a trainer loads (an MLX or GGUF conversion), or None."""
    return next((why for pattern, why in REFUSED if pattern.search(name)), None)


def did_you_mean(name: str, choices) -> str:
    """", did you mean 'x'?" for the nearest of `choices` (difflib's ratio >= 0.8), else ""."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.8)
    return f", did you mean {close[0]!r}?" if close else ""


def resolve(name: str) -> str:
    """The preset a hub id names; anything that is not a hub id (a preset, a path) unchanged.
    An unknown hub id is a one-line SpecError: nothing is downloaded."""
    if not looks_like_hub_id(name):
        return name
    why = refusal(name)
    if why is not None:
        raise SpecError("model", name, reason=f"{why}: name the checkpoint it was converted "
                        "from (its owner/name on the hub), or a preset (hybridmem models)")
    preset = preset_for(name)
    if preset is None:
        raise SpecError("model", name, reason="unknown hub id" + did_you_mean(name, HUB_PRESETS)
                        + "; hybridmem downloads nothing: pass a local config.json path (or "
                        "its folder), or a preset (hybridmem models)")
    return preset
