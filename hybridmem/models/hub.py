"""Hugging Face hub ids -> shipped presets: `--model meta-llama/Llama-3.2-3B` and a launcher
config's `model_name_or_path` / `base_model` name the preset of that checkpoint.

Why: users name models by their hub id; hybridmem downloads nothing, so an id maps to the preset
that transcribes that checkpoint's config.json, and an id with no preset is a one-line error
asking for a local config.json. Each preset's `_source` names the checkpoint it transcribes; an
entry below names that checkpoint, or a sibling whose config.json has the same shape fields (an
-Instruct / -it / -Base twin: the same architecture, other token ids), said beside it.
Lookups ignore case (the hub resolves ids case-insensitively).
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
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3-vl-8b-instruct",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3-vl-30b-a3b-instruct",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "smolvlm-256m-instruct",
    "HuggingFaceTB/SmolVLM-500M-Instruct": "smolvlm-500m-instruct",
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": "smolvlm2-2.2b-instruct",
}
"""Hub id (as the model page spells it) -> preset name."""

_BY_LOWER: dict[str, str] = {k.lower(): v for k, v in HUB_PRESETS.items()}

# a hub repo id: "owner/name", each part letters, digits, '-', '_', '.' (huggingface_hub
# `validate_repo_id`: no "--" or "..", not starting or ending with '-' or '.')
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(name: str) -> bool:
    """`owner/name` that is not a path on this machine (a local folder of that name wins)."""
    return (isinstance(name, str) and bool(_REPO_ID.match(name)) and ".." not in name
            and not name.endswith(".json") and not Path(name).expanduser().exists())


def preset_for(hub_id: str) -> str | None:
    """The preset of a hub id (any case), or None."""
    return _BY_LOWER.get(hub_id.lower()) if isinstance(hub_id, str) else None


def resolve(name: str) -> str:
    """The preset a hub id names; anything that is not a hub id (a preset, a path) unchanged.
    An unknown hub id is a one-line SpecError: nothing is downloaded."""
    if not looks_like_hub_id(name):
        return name
    preset = preset_for(name)
    if preset is None:
        raise SpecError("model", name, reason="unknown hub id, and hybridmem downloads nothing: "
                        "pass a local config.json path (or its folder), or a preset "
                        "(hybridmem models)")
    return preset
