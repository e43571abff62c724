"""PEFT's adapter config (`--peft-config`: an `adapter_config.json`, or its folder) -> the
trained parameters and the LoRA settings of one layer, each with the file key it came from.

The file is read by `hybridmem.adapters` (every PEFT method the analytic tier prices); keys the
installed peft's config class does not declare are warnings (`hybridmem.intake.config_keys`).
"""

from __future__ import annotations

import os
from dataclasses import fields

from hybridmem.adapters import read_adapter_config, spec_fields
from hybridmem.errors import SpecError
from hybridmem.intake import config_keys
from hybridmem.intake.readers.common import file_source, key_where, used_keys
from hybridmem.job.spec import LoraSpec


def from_peft_config(source: str | os.PathLike | dict,
                     train: str | None = None) -> tuple[dict, dict, dict]:
    """(spec fields, LoRA fields, sources) of the adapter config at `source`; `train`, the
    `--train` given beside it, must agree with the file's method."""
    spec, lora, sources = {}, {}, {}
    cfg = read_adapter_config(source)
    where = key_where(source, "peft_config")
    known = config_keys.peft_known(cfg["peft_type"])
    if known is not None:
        config_keys.check_keys("peft", cfg, where, used=used_keys("peft"), known=lambda: known)
    adapter = spec_fields(cfg)
    if train not in (None, adapter["train"]):
        raise SpecError("train", train, [adapter["train"]],
                        reason="--peft-config sets the trained parameters")
    spec["train"] = adapter["train"]
    sources["train"] = f"{where}: peft_type"
    if adapter["train"] == "lora":
        lora.update({f.name: getattr(adapter["lora"], f.name) for f in fields(LoraSpec)})
        sources.update({f"lora_{f.name}": file_source(where, "peft", f"lora_{f.name}", cfg)
                        for f in fields(LoraSpec)})
    else:
        spec["peft_config"] = adapter["peft_config"]
        sources["peft_config"] = where
    return spec, lora, sources
