"""What a launcher dialect module provides; `hybridmem.intake.dialects` finds every module of
this package that does (one file adds a launcher: CLI, HTTP API and `--config-format` follow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from hybridmem.intake.dialects.common import LauncherConfig


class Dialect(Protocol):
    """One launcher's config file, read as that launcher reads it."""

    NAME: str
    """The launcher as sources and warnings name it ("LLaMA-Factory", "axolotl", ...)."""
    SOURCE: str
    """Its `--config-format` name, also its key set in `hybridmem.intake.config_keys`."""
    DETECT_ORDER: int
    """Where `detect` is tried among the dialects, lowest first: a dialect whose marker key a
    file of another launcher may also hold is tried after that launcher."""

    @staticmethod
    def detect(cfg: dict) -> bool:
        """Whether the parsed file's keys are this launcher's."""

    @staticmethod
    def read(raw: dict, where: str, folder: Path, model: str | None = None) -> LauncherConfig:
        """The file as one `merge_inputs` layer (and the DeepSpeed config it names); `where`
        names it in sources, `folder` is where the launcher looks for the files it names;
        `model`: the `--model` flag's, read in place of the file's (`common.model_of`)."""


REQUIRED: tuple[str, ...] = ("NAME", "SOURCE", "DETECT_ORDER", "detect", "read")
"""The attributes a module must have to be a dialect."""
