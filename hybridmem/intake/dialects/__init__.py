"""`--config FILE`: a launcher's own training config, read as that launcher reads it.

Why: users launch with LLaMA-Factory (`llamafactory-cli train x.yaml`), axolotl (`axolotl train
x.yml`) or torchtune (`tune run recipe --config x.yaml`); each fills what the file leaves out
with its own defaults (LLaMA-Factory checkpoints unless told not to, axolotl's sequence length
is 512, ...); `accelerate launch --config_file` adds how the processes shard and cast. One
module per launcher (`dialects/protocol.py`: its name, `detect`, `read`) turns its file into one
`merge_inputs` layer, with the launcher's defaults where the file is silent and the source of every field; every key of the
file is read, known to the launcher (no memory effect), or a warning naming the nearest known
key (`hybridmem.intake.config_keys`). The dialect is told by the keys (`detect`), or forced.
"""

from __future__ import annotations

import os
import pkgutil
from importlib import import_module
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.intake.dialects.common import LauncherConfig, load_yaml
from hybridmem.intake.dialects.protocol import REQUIRED, Dialect


def _registry() -> dict[str, Dialect]:
    """`SOURCE` -> module, of every module here that provides the dialect protocol
    (`protocol.REQUIRED`), in the order `detect` tries them (`DETECT_ORDER`)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = import_module(f"{__name__}.{info.name}")
        if all(hasattr(module, name) for name in REQUIRED):
            found.append(module)
    return {m.SOURCE: m for m in sorted(found, key=lambda m: (m.DETECT_ORDER, m.SOURCE))}


DIALECTS: dict[str, Dialect] = _registry()
"""--config-format name -> its reader, in the order `detect` tries them."""


def detect(cfg: dict, where: str) -> str:
    """The dialect a config's keys tell: torchtune's model `_component_`, axolotl's
    `base_model`, LLaMA-Factory's method keys (`finetuning_type` / `stage` /
    `model_name_or_path` with `cutoff_len`), accelerate's `distributed_type`, torchtitan's
    `[parallelism]`, Megatron-LM's `--num-layers`."""
    for name, dialect in DIALECTS.items():
        if dialect.detect(cfg):
            return name
    raise SpecError("config", where, list(DIALECTS),
                    reason="cannot tell the launcher from its keys; give --config-format")


def read_config(path: str | os.PathLike, config_format: str | None = None,
                model: str | None = None) -> LauncherConfig:
    """The config file at `path`, in `config_format` (else the one its keys tell); `model`: the
    `--model` flag's, read in place of the file's."""
    if config_format is not None and config_format not in DIALECTS:
        raise SpecError("config_format", config_format, list(DIALECTS))
    where = os.fspath(path)
    return read_mapping(_load(path, config_format), where,
                        Path(where).expanduser().resolve().parent, config_format, model)


def _load(path: str | os.PathLike, config_format: str | None) -> dict:
    """The file as its launcher parses it: a dialect with a format of its own (`load`, and the
    `SUFFIXES` that name it: torchtitan's TOML, Megatron-LM's command-line arguments) when
    forced or told by the file's suffix, else YAML."""
    suffix = Path(path).suffix
    own = DIALECTS.get(config_format) if config_format else next(
        (d for d in DIALECTS.values() if suffix in getattr(d, "SUFFIXES", ())), None)
    if own is not None and hasattr(own, "load"):
        return own.load(path)
    return load_yaml(path)


def read_mapping(cfg: dict, where: str, folder: Path,
                 config_format: str | None = None, model: str | None = None) -> LauncherConfig:
    """A config already parsed (the HTTP API's pasted text), named `where` in the sources and
    warnings; `folder` is where the launcher would look for the files it names."""
    if config_format is not None and config_format not in DIALECTS:
        raise SpecError("config_format", config_format, list(DIALECTS))
    dialect = config_format or detect(cfg, where)
    return DIALECTS[dialect].read(cfg, where, folder, model)


__all__ = ["DIALECTS", "LauncherConfig", "detect", "read_config", "read_mapping"]
