"""The model registry: one folder per trained residual under `models/` (or `$HYBRIDMEM_MODELS`).

Layout of `models/NAME/` (see models/README.md):
  metadata.json                       provenance, environment, training ranges, metrics
  device.point.txt / device.upper.txt LightGBM text models for the device peak residual
  reserved.point.txt / ...upper.txt   the same for the reserved peak
  device.json / reserved.json         hyperparameters and feature encoding
Folders are written to a temporary sibling and renamed into place, so a crash never leaves a
half-written model and an existing NAME is only replaced with `force=True`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridmem.environment import installed
from hybridmem.errors import SpecError
from hybridmem.learned.versions import major_minor

FORMAT_VERSION = 1
"""Bump when files or features change incompatibly; older folders are refused with a clear error."""

TARGETS: tuple[str, ...] = ("device", "reserved")


SHIPPED = Path(__file__).resolve().parents[1] / "shipped_models"
"""The models shipped with hybridmem: `hybridmem/shipped_models` links to the checkout's
`models/` and is installed as package data (pyproject.toml), so it is found from any directory."""


def models_root() -> Path:
    """Registry folder: `$HYBRIDMEM_MODELS`, else the models shipped with hybridmem (`SHIPPED`),
    wherever hybridmem runs (never the current directory)."""
    return Path(os.environ.get("HYBRIDMEM_MODELS") or SHIPPED)


@dataclass
class LoadedModel:
    name: str
    path: Path
    metadata: dict
    estimators: dict
    """target ("device", "reserved") -> fitted ResidualRegressor."""


def check_out_path(out: str | Path, force: bool) -> Path:
    """Validate `--out` before any work: refuse an existing folder unless forced."""
    path = Path(out)
    if not path.name or path.name.startswith("."):
        raise SpecError("out", str(out), reason="give a folder name such as models/NAME")
    if path.exists() and not force:
        raise SpecError("out", str(out), reason="already exists; pass --force to replace it")
    if path.exists() and not path.is_dir():
        raise SpecError("out", str(out), reason="exists and is not a folder")
    return path


def save(out: str | Path, estimators: dict, metadata: dict, force: bool = False) -> Path:
    """Write a registry entry atomically (temp folder + rename); returns its path."""
    path = check_out_path(out, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for target, est in estimators.items():
            est.save(tmp, target)
        meta = {**metadata, "format_version": FORMAT_VERSION, "name": path.name}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_metadata(path: str | Path) -> dict:
    """metadata.json of an entry, with its format version checked."""
    file = Path(path) / "metadata.json"
    try:
        meta = json.loads(file.read_text())
    except OSError:
        raise SpecError("model", str(path), reason="not a registry entry (no metadata.json)") from None
    except json.JSONDecodeError as err:
        raise SpecError("model", str(path), reason=f"metadata.json is malformed ({err.msg})") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise SpecError("model", str(path),
                        reason=f"format_version {version!r} is incompatible with this hybridmem "
                               f"(expects {FORMAT_VERSION}); retrain it with `hybridmem train`")
    return meta


def load(path: str | Path) -> LoadedModel:
    """A registry entry with its fitted estimators (lightgbm imported here, lazily)."""
    from hybridmem.learned.model import ResidualRegressor

    path = Path(path)
    meta = read_metadata(path)
    estimators = {t: ResidualRegressor.load(path, t) for t in meta.get("targets", TARGETS)}
    return LoadedModel(name=path.name, path=path, metadata=meta, estimators=estimators)


def user_env() -> dict[str, str | None]:
    """torch / CUDA versions to match models against.

    `$HYBRIDMEM_TORCH_VERSION` / `$HYBRIDMEM_CUDA_VERSION` describe the target cluster when it
    differs from this machine; else the installed torch, and CUDA only if torch is already
    imported (importing torch just for this would cost seconds; a CPU wheel has no CUDA).
    """
    torch_v = os.environ.get("HYBRIDMEM_TORCH_VERSION")
    if not torch_v:
        torch_v = installed("torch")
    cuda_v = os.environ.get("HYBRIDMEM_CUDA_VERSION")
    if not cuda_v and "torch" in sys.modules:
        cuda_v = getattr(getattr(sys.modules["torch"], "version", None), "cuda", None)
    return {"torch": torch_v, "cuda": cuda_v}


def _majors(versions) -> set[str]:
    return {str(v).split(".")[0] for v in versions if v}


def select(root: Path, torch_version: str | None, cuda_version: str | None
           ) -> tuple[Path | None, list[str]]:
    """The registry entry to use for this environment, and notes explaining the choice.

    Compatible: readable format, same torch major, same CUDA major when both are known.
    Preference: the user's torch major.minor among the trained versions, then calibrated to
    real GPUs, then newest (`created_at`). Notes warn when the pick is out of its training range.
    """
    notes: list[str] = []
    candidates = []
    if not root.is_dir():
        return None, [f"no model registry at {root}"]
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            meta = read_metadata(folder)
        except SpecError as err:
            if (folder / "metadata.json").exists():
                notes.append(f"skipped {folder.name}: {err.reason}")
            continue
        torch_trained = meta.get("torch_versions", [])
        cuda_trained = meta.get("cuda_versions", [])
        if torch_version and _majors(torch_trained) and \
                str(torch_version).split(".")[0] not in _majors(torch_trained):
            continue
        if cuda_version and _majors(cuda_trained) and \
                str(cuda_version).split(".")[0] not in _majors(cuda_trained):
            continue
        exact = major_minor(torch_version) in {major_minor(v) for v in torch_trained}
        candidates.append((exact, bool(meta.get("calibrated_to_gpu")), meta.get("created_at", ""),
                           folder, meta))
    if not candidates:
        return None, notes + [f"no model in {root} matches torch {torch_version or '?'}, "
                              f"CUDA {cuda_version or '?'}"]
    exact, _, _, folder, meta = max(candidates, key=lambda c: c[:3])
    if not exact:
        notes.append(f"torch {torch_version} is outside the torch versions model {folder.name} was "
                     f"trained on ({', '.join(meta.get('torch_versions', []))}); its residuals "
                     "answer only the job groups their held-out evidence trusts; collect rows on "
                     "this version to retrain (models/README.md)")
    if cuda_version is None:
        notes.append("CUDA version unknown here (set HYBRIDMEM_CUDA_VERSION); matched on torch only")
    return folder, notes
