"""A PEFT `adapter_config.json` -> the spec fields that price it.

LoRA and DoRA configs the analytic tier can price exactly become `train='lora'` with a
`LoraSpec`; every other method (and LoRA with per-layer patterns the closed forms do not
model) becomes `train='peft'` with the config kept whole, for the trace tier to build with
`peft.get_peft_model`. Read at the boundary: a malformed file is a one-line `SpecError`.
"""

from __future__ import annotations

import json
import os
import re

from hybridmem.errors import SpecError
from hybridmem.jsonfile import parse_json, read_json_text
from hybridmem.job.spec import DEFAULT_LORA_TARGETS, LoraSpec

# PEFT's `target_modules="all-linear"`: every Linear but the output layer
# (peft/tuners/tuners_utils.py `_maybe_include_all_linear_layers`), which for the decoders we
# price is exactly LLaVA's `find_all_linear_names` list.
ALL_LINEAR = "all-linear"
# LoRA config keys that change which layers get which rank: when set, the closed forms (one
# r for every target) do not describe the model, so the trace tier prices it.
PER_LAYER_KEYS = ("rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication",
                  "exclude_modules")
# LoRA keys with a memory effect the analytic tier does not model; set -> trace tier.
UNMODELLED_LORA = {"use_qalora": True, "lora_bias": True, "bias": ("all", "lora_only")}


def read_adapter_config(source: str | os.PathLike | dict) -> dict:
    """The JSON object of an adapter_config.json (a file, its folder, or the dict itself)."""
    if isinstance(source, dict):
        cfg = source
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "adapter_config.json")
        if not os.path.exists(path):
            raise SpecError("peft_config", os.fspath(source), reason="no such file")
        cfg = parse_json(read_json_text(path, "peft_config"), "peft_config", os.fspath(source))
    if not isinstance(cfg, dict) or not isinstance(cfg.get("peft_type"), str):
        raise SpecError("peft_config.peft_type", cfg.get("peft_type") if isinstance(cfg, dict)
                        else cfg, reason="an adapter_config.json names its method in peft_type")
    return cfg


def canonical(cfg: dict) -> str:
    """The config as one canonical JSON string (a frozen spec field, hashable, stable)."""
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def _targets(value: object) -> tuple[str, ...]:
    """LoRA target names as suffixes (a regex string: the default names, `_regex` holds it)."""
    if value is None or value == ALL_LINEAR or isinstance(value, str):
        return DEFAULT_LORA_TARGETS
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, str) for t in value):
        return tuple(sorted(value))
    raise SpecError("peft_config.target_modules", value,
                    reason="must be a list of module names, 'all-linear' or a regex string")


def _analytic_lora(cfg: dict) -> bool:
    if any(cfg.get(k) for k in PER_LAYER_KEYS):
        return False
    for key, bad in UNMODELLED_LORA.items():
        value = cfg.get(key)
        if (value in bad) if isinstance(bad, tuple) else value == bad:
            return False
    return True


def _regex(value: object) -> str | None:
    """A string `target_modules` other than "all-linear": the regex PEFT full-matches
    (`LoraSpec.target_regex`)."""
    return value if isinstance(value, str) and value != ALL_LINEAR else None


def spec_fields(source: str | os.PathLike | dict) -> dict:
    """TrainingSpec keyword arguments (`train` plus `lora` or `peft_config`) for an adapter."""
    cfg = read_adapter_config(source)
    if cfg["peft_type"].upper() == "LORA" and _analytic_lora(cfg):
        try:
            lora = LoraSpec(
                r=cfg.get("r", 8), alpha=float(cfg.get("lora_alpha", 8)),
                targets=_targets(cfg.get("target_modules")),
                target_regex=_regex(cfg.get("target_modules")),
                dropout=float(cfg.get("lora_dropout", 0.0)),
                use_dora=bool(cfg.get("use_dora", False)),
                use_rslora=bool(cfg.get("use_rslora", False)),
                modules_to_save=tuple(cfg.get("modules_to_save") or ()))
        except SpecError as err:
            raise SpecError(f"peft_config.{err.field.removeprefix('lora.')}", err.value,
                            err.choices, err.reason) from None
        return {"train": "lora", "lora": lora}
    return {"train": "peft", "peft_config": canonical(cfg)}


def peft_type(spec) -> str | None:
    """The PEFT method a spec trains (LORA, DORA, IA3, ...), None for no adapter."""
    if spec.train == "lora":
        return "DORA" if spec.lora.use_dora else "LORA"
    if spec.train == "peft":
        return config_type(json.loads(spec.peft_config))
    return None


GROUPS: tuple[str, ...] = ("full", "lora", "dora", "other-peft", "partial")
"""How accuracy is reported: full fine-tuning, LoRA, DoRA, any other PEFT method,
and partial training of a multimodal model (LLaVA's projector / llm+projector stages)."""


def group_of(kind: str | None, train: str = "full") -> str:
    """The `GROUPS` entry of a PEFT method (`peft_type`'s answer; None: no adapter)."""
    if kind is None:
        return "full" if train == "full" else "partial"
    return {"LORA": "lora", "DORA": "dora"}.get(kind.upper(), "other-peft")


def config_type(cfg: dict | None) -> str | None:
    """`peft_type` of an adapter_config dict, DoRA told apart from LoRA (None: no adapter)."""
    if cfg is None:
        return None
    kind = str(cfg.get("peft_type", "")).upper()
    return "DORA" if kind == "LORA" and cfg.get("use_dora") else kind


def job_group(spec) -> str:
    """The `GROUPS` entry a spec belongs to."""
    return group_of(peft_type(spec), spec.train)


# PEFT methods that prepend virtual tokens inside `PeftModelForCausalLM.forward` (peft_model.py:
# prompt embeddings concatenated to `inputs_embeds`, labels padded with -100; prefix tuning
# hands `past_key_values` instead). They need `task_type=CAUSAL_LM` to get that forward.
PROMPT_LEARNING = frozenset({"PROMPT_TUNING", "PREFIX_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING",
                             "ADAPTION_PROMPT", "CPT"})
# Prompt-tuning initialisations that need a tokenizer download (peft PromptEmbedding `TEXT`):
# the prompt embedding has the same shape and dtype whatever its values, so the trace tier and
# the harness build it RANDOM (peft/tuners/prompt_tuning/model.py).
TOKENIZER_INITS = {"prompt_tuning_init": ("TEXT",)}


def lora_llm_pattern(targets: tuple[str, ...]) -> str:
    """PEFT `target_modules` regex for LoRA on the named linears outside the vision tower and
    the projector (the LLaVA finetune_lora recipe: CLIP's q/k/v_proj get no adapters; the same
    parts of other VLMs, `models.build.NON_LM_FRAGMENTS`)."""
    from hybridmem.models.build import NON_LM_FRAGMENTS

    skip = "|".join(map(re.escape, NON_LM_FRAGMENTS))
    return rf"^(?!.*({skip})).*\.(" + "|".join(map(re.escape, targets)) + r")$"


def _method_config(spec) -> dict:
    """The spec's non-LoRA adapter config as PEFT takes it (upper-case type, causal-LM task)."""
    cfg = json.loads(spec.peft_config)
    cfg["peft_type"] = str(cfg["peft_type"]).upper()
    if cfg["peft_type"] in PROMPT_LEARNING and not cfg.get("task_type"):
        cfg["task_type"] = "CAUSAL_LM"
    for key, needs_download in TOKENIZER_INITS.items():
        if cfg.get(key) in needs_download:
            cfg[key] = "RANDOM"
    return cfg


def build_peft_config(spec):
    """The `peft.PeftConfig` a spec trains with: a `LoraConfig` from `spec.lora` (DoRA, rsLoRA,
    modules_to_save included), or the spec's adapter_config.json as PEFT reads it.

    One builder for the trace tier and the CUDA harness, so both build the same adapters.
    Unknown methods are a one-line `SpecError` naming the method."""
    import peft

    if spec.train == "lora":
        lora = spec.lora
        return peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                               target_modules=lora.target_regex
                               or lora_llm_pattern(lora.targets), bias="none",
                               use_dora=lora.use_dora, use_rslora=lora.use_rslora,
                               modules_to_save=list(lora.modules_to_save) or None)
    cfg = _method_config(spec)
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    if cfg["peft_type"] not in PEFT_TYPE_TO_CONFIG_MAPPING:
        raise SpecError("peft_config.peft_type", cfg["peft_type"],
                        reason=f"peft {peft.__version__} has no such method")
    try:
        # `from_peft_type` drops keys this PEFT version does not know (files from newer PEFT)
        return peft.PeftConfig.from_peft_type(**cfg)
    except Exception as err:  # noqa: BLE001 - PEFT's own validation, any exception type
        raise build_error(spec, err) from None


def build_error(spec, err: BaseException) -> SpecError:
    """A one-line `SpecError` for a method PEFT refuses to build on this model."""
    text = " ".join(str(err).split())[:300]
    return SpecError("peft_config", peft_type(spec),
                     reason=f"peft cannot build this adapter on {spec.model} "
                     f"({type(err).__name__}: {text})")
