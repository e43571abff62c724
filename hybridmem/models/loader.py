"""Model configs from shipped presets or local files: never from a hub.

A model is named by a preset (a HF `config.json` shipped in a family folder,
`hybridmem/families/<family>/presets/`) or by a path to a config.json or to a folder holding
one. The result is a `transformers.PretrainedConfig`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.jsonfile import read_json_object

from hybridmem.families import DECODER, VLM, family, types
from hybridmem.models.hub import did_you_mean, prequantized, resolve as resolve_hub_id

# model_type values with closed forms (`hybridmem/families/`, one folder per family); the trace
# tier prices every other transformers causal-LM / image-text-to-text family.
MULTIMODAL_TYPES: tuple[str, ...] = types(VLM)
DECODER_TYPES: tuple[str, ...] = types(DECODER)
SUPPORTED_TYPES: tuple[str, ...] = MULTIMODAL_TYPES + DECODER_TYPES
"""The families the analytic tier has closed forms for (and the hybrid tier, built on it)."""
TRACE_ONLY_CHOICE = "any transformers causal-LM / image-text-to-text model_type with --method trace"
"""The rest of the valid choices, as the one-line error names them."""
CAUSAL_LM = "AutoModelForCausalLM"
IMAGE_TEXT_TO_TEXT = "AutoModelForImageTextToText"


@lru_cache(maxsize=1)
def transformers_types() -> dict[str, str]:
    """model_type -> the transformers Auto class that builds it, for every family the installed
    transformers can build as a causal LM or an image-text-to-text model
    (`transformers.models.auto.modeling_auto` `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`,
    `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`). A family in both (gemma3, mllama, ...) is
    built as image-text-to-text, as LLaVA is: its causal-LM entry names the same
    `...ForConditionalGeneration` class. Imported only when a config is not an analytic family
    (the import costs ~2 s)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    out = dict.fromkeys(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, CAUSAL_LM)
    out.update(dict.fromkeys(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, IMAGE_TEXT_TO_TEXT))
    return out


def is_analytic(model_type: str) -> bool:
    """Whether the analytic tier has closed forms for this family (else: trace tier only)."""
    return model_type in SUPPORTED_TYPES


def auto_class(model_type: str) -> str:
    """Name of the transformers Auto class that builds `model_type` (`transformers_types`);
    a declared family by its kind (LLaVA: image-text-to-text)."""
    fam = family(model_type)
    if fam is not None:
        return IMAGE_TEXT_TO_TEXT if fam.kind == VLM else CAUSAL_LM
    return transformers_types()[model_type]


def is_multimodal(model_type: str) -> bool:
    """Whether the family takes images (built as image-text-to-text)."""
    return auto_class(model_type) == IMAGE_TEXT_TO_TEXT


def analytic_refusal(model_type: str) -> SpecError:
    """The analytic tier's one line for a family without closed forms (`analytic.scope`;
    `predict` adds the tier that prices it)."""
    return SpecError("model_type", model_type,
                     reason="this family has no closed forms here")


@lru_cache(maxsize=1)
def _presets() -> dict[str, tuple[str, Path]]:
    """Preset name -> (the family folder that ships it, its config.json): the file stems of
    `hybridmem/families/<family>/presets/*.json` (not a preset's `NAME.preprocessor_config.json`).
    A name shipped twice is refused."""
    roots = [(d.name, d / "presets") for d in resources.files("hybridmem.families").iterdir()
             if d.is_dir() and (d / "presets").is_dir()]
    out: dict[str, tuple[str, Path]] = {}
    for folder, root in roots:
        for p in root.iterdir():
            if p.name.endswith(".json") and not p.name.endswith(PREPROCESSOR_SUFFIX):
                name = p.name[:-5]
                if name in out:
                    raise RuntimeError(f"preset {name!r} shipped twice ({folder}, {out[name][0]})")
                out[name] = (folder, Path(str(p)))
    return out


def preset_names() -> tuple[str, ...]:
    """Names of the shipped presets (file stems of every family folder's `presets/*.json`)."""
    return tuple(sorted(_presets()))


def preset_folder(name: str) -> str:
    """The family folder (`hybridmem/families/<folder>/`) that ships preset `name`."""
    return _presets()[name][0]


PREPROCESSOR_SUFFIX = ".preprocessor_config.json"
"""A preset's image-processor limits beside its config (`presets/NAME.preprocessor_config.json`:
the pixel keys of the checkpoint's `preprocessor_config.json`), not a preset itself."""
PREPROCESSOR_KEY = "preprocessor_pixels"
"""The config key the processor's pixel range is carried under, [min_pixels, max_pixels]
(`preprocessor_pixels`), read by the native-resolution families' image rule."""


def preprocessor_pixels(data: dict) -> list[int] | None:
    """[min_pixels, max_pixels] of a `preprocessor_config.json`: its top-level `min_pixels` /
    `max_pixels` (Qwen2-VL / Qwen2.5-VL checkpoints), else `size.shortest_edge` /
    `size.longest_edge` (the fast processors' dump, Qwen3-VL checkpoints): the keys
    transformers' `Qwen2VLImageProcessor.__init__` reads, top-level ones first. None when it
    has neither (another family's processor)."""
    size = data.get("size") if isinstance(data.get("size"), dict) else {}
    lo = data.get("min_pixels", size.get("shortest_edge"))
    hi = data.get("max_pixels", size.get("longest_edge"))
    if isinstance(lo, int) and isinstance(hi, int) and 0 < lo <= hi:
        return [lo, hi]
    return None


def _with_preprocessor(data: dict, path: Path) -> dict:
    """`data` with the pixel range of the `preprocessor_config.json` at `path`, if any (a
    malformed one is a one-line error naming it; a config that sets the key keeps it)."""
    if PREPROCESSOR_KEY in data or not path.is_file():
        return data
    pixels = preprocessor_pixels(read_json_object(path, "model: preprocessor_config.json"))
    return {**data, PREPROCESSOR_KEY: pixels} if pixels else data


def load_config_dict(model: str) -> tuple[str, dict]:
    """(display name, raw config dict) for a preset name, a hub id or a config path. A
    pre-quantised upload's id (`hub.prequantized`) adds the `quantization_config` its
    config.json carries; the processor's pixel range is carried beside it (`PREPROCESSOR_KEY`)
    where a `preprocessor_config.json` sits in the same folder (a preset's
    `NAME.preprocessor_config.json`)."""
    hub_id, model = model, resolve_hub_id(model)  # a hub id names its preset (models/hub.py)
    if model in _presets():
        path = _presets()[model][1]
        data = _with_preprocessor(read_json_object(path, "model"),
                                  path.with_name(model + PREPROCESSOR_SUFFIX))
        quant = prequantized(hub_id)
        return model, ({**data, "quantization_config": quant} if quant else data)
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise SpecError("model", model, reason="folder has no config.json")
    if path.suffix == ".json" or path.is_file():
        if not path.exists():
            raise SpecError("model", model, reason="no such file")
        return str(model), _with_preprocessor(read_json_object(path, "model"),
                                              path.with_name("preprocessor_config.json"))
    hint = did_you_mean(model, preset_names())
    if hint:  # the one near name, not the whole list (`hybridmem models` lists it)
        raise SpecError("model", model, reason=f"unknown preset{hint} (hybridmem models lists "
                        "them all)")
    raise SpecError("model", model, preset_names() + ("<path to config.json>",),
                    reason="unknown preset")


def validate_types(data: dict) -> str:
    """The config's model_type, after checking it and its sub-configs' types are supported."""
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        if isinstance(model_type, str) and model_type in transformers_types():
            return model_type  # the trace tier builds it with its own Auto class, sub-configs too
        raise SpecError("model_type", model_type, SUPPORTED_TYPES + (TRACE_ONLY_CHOICE,))
    check = family(model_type).check_config
    if check is not None:  # sub-config families (hybridmem/families/<family>/)
        check(data)
    return model_type


@lru_cache(maxsize=64)
def _config_from_json(text: str):
    from transformers import AutoConfig

    data = json.loads(text)
    model_type = validate_types(data)
    clean = {k: v for k, v in data.items() if not k.startswith("_")}
    clean.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **clean)
    except (TypeError, ValueError, KeyError) as err:
        raise SpecError("model", model_type, reason=f"config rejected by transformers: {err}") from None


def model_type_of(model: str) -> str:
    """The validated model_type of a preset or config path (no transformers import for the
    analytic families): the one check every tier shares at the boundary."""
    _, data = load_config_dict(model)
    return validate_types(data)


def load_config(model: str):
    """A `transformers.PretrainedConfig` for a preset name or a config path."""
    _, data = load_config_dict(model)
    return load_config_data(data)


def load_config_data(data: dict):
    """A `transformers.PretrainedConfig` for a config dict (cached by content)."""
    return _config_from_json(json.dumps(data, sort_keys=True))


def cache_root() -> Path:
    """hybridmem's cache folder: `$HYBRIDMEM_CACHE`, else `~/.cache/hybridmem` (safe to delete)."""
    import os
    return Path(os.environ.get("HYBRIDMEM_CACHE") or Path.home() / ".cache" / "hybridmem")


def config_cache_dir() -> Path:
    """Folder for configs materialised from dataset rows (content-addressed, safe to delete)."""
    return cache_root() / "configs"


def materialize_config(config_json: str) -> str:
    """Write a config JSON text to a content-addressed file and return its path.

    Dataset rows store the full HF config (sweeps build custom-sized models); tiers take a
    path, so this turns a row back into a `TrainingSpec.model` value.
    """
    import hashlib
    import os

    data = json.loads(config_json)
    text = json.dumps(data, sort_keys=True, indent=1)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = config_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.json"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path)
