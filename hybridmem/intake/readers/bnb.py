"""bitsandbytes' `BitsAndBytesConfig` (`--quantization-config`, or the `quantization_config` of
a pre-quantised model's config.json) -> the quantisation fields of one layer, with their
sources (`hybridmem.techniques.quantize.from_bnb_config` maps the keys).
"""

from __future__ import annotations

import os

from hybridmem.errors import SpecError
from hybridmem.intake import config_keys
from hybridmem.intake.readers.common import file_source, key_where, used_keys
from hybridmem.jsonfile import read_json_object


def _bnb_dict(source: str | os.PathLike | dict) -> dict:
    """The BitsAndBytesConfig object of `--quantization-config`: the JSON itself, or the
    `quantization_config` of a model's config.json (a file or its folder)."""
    if isinstance(source, dict):
        return source
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    data = read_json_object(path, "quantization_config")
    if "quantization_config" in data and "load_in_4bit" not in data \
            and "_load_in_4bit" not in data:
        data = data["quantization_config"]  # a model config.json
    return data


def quantization(overrides: dict, model: str | None = None) -> tuple[dict, dict]:
    """Quantisation fields (and their sources) from `--quantization-config FILE` (a
    BitsAndBytesConfig JSON), else from the `quantization_config` inside the model's
    config.json (a pre-quantised checkpoint's); `--quantize` given alone keeps the spec's
    defaults (QLoRA: nf4 + double quant). A `--quantize` that contradicts the file is an error
    naming both."""
    from hybridmem.techniques.quantize import from_bnb_config

    out: dict = {}
    where, data = None, {}
    model = model or overrides.get("model")
    if overrides.get("quantization_config") is not None:
        source = overrides["quantization_config"]
        data = _bnb_dict(source)
        where = key_where(source, "quantization_config")
        config_keys.check_keys("bnb", data, where, used=used_keys("bnb"),
                               known=config_keys.bnb_known)
        out = from_bnb_config(data)
    elif model:
        from hybridmem.models.loader import load_config_dict

        try:  # the JSON itself: transformers keeps `quantization_config` as the dict it reads
            qc = load_config_dict(model)[1].get("quantization_config")
        except SpecError:
            qc = None  # the model's own error comes where the model is built
        if qc:
            data = qc if isinstance(qc, dict) else qc.to_dict()
            where = f"{model} config.json: quantization_config"
            out = from_bnb_config(data, "model.quantization_config")
    given = overrides.get("quantize")
    if out and given is not None and given != out["quantize"]:
        if given == "none":
            return {}, {}
        raise SpecError("quantize", given, [out["quantize"], "none"],
                        reason="--quantization-config / the model's quantization_config says "
                        f"{out['quantize']!r}")
    return out, {key: file_source(where, "bnb", key, data) for key in out}
