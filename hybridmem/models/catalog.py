"""What a user can name: every shipped preset with its family, kind, parameter count and the
tiers that price it (`hybridmem models`).

Why: the README's preset list went stale as families were added; this is read from the presets
and the family registry (`hybridmem/families/`), so it cannot. Parameter counts come from the
analytic graph (equal to the meta-device model's, tests/test_models.py); a family only the
trace tier prices has none here (counting it means building the model: `predict` does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hybridmem.families import VLM, family
from hybridmem.models.loader import load_config_dict, preset_folder, preset_names, validate_types

TRACE_ONLY = ("trace",)
ALL_TIERS = ("analytic", "trace", "hybrid")


@dataclass(frozen=True, slots=True)
class PresetInfo:
    name: str
    family: str
    """The family folder that ships it (`hybridmem/families/<family>/presets/`)."""
    model_type: str
    kind: str
    """"vlm" or "decoder"."""
    params: int | None
    """Total parameters (analytic graph); None for a trace-only family."""
    tiers: tuple[str, ...]
    source: str
    """The preset's `_source`: the published config.json it transcribes, or "hand-made"."""

    def as_dict(self) -> dict:
        return asdict(self)


def _params(name: str) -> int:
    from hybridmem.models.build import build_graph
    from hybridmem.job.spec import TrainingSpec

    # parameters do not depend on the batch; a long sequence fits any family's image tokens
    return build_graph(TrainingSpec(model=name, micro_batch=1, seq_len=1 << 20)).num_params


def preset_info(name: str) -> PresetInfo:
    _, data = load_config_dict(name)
    model_type = validate_types(data)
    fam = family(model_type)
    analytic = fam is not None  # every declared family has closed forms
    kind = fam.kind if fam is not None else ("vlm" if "vision_config" in data else "decoder")
    return PresetInfo(name=name, family=preset_folder(name), model_type=model_type, kind=kind,
                      params=_params(name) if analytic else None,
                      tiers=ALL_TIERS if analytic else TRACE_ONLY,
                      source=str(data.get("_source", "")))


def catalog() -> list[PresetInfo]:
    """Every shipped preset, VLMs first, then by name."""
    rows = [preset_info(n) for n in preset_names()]
    return sorted(rows, key=lambda r: (r.kind != VLM, r.name))
