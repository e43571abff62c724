"""`hybridmem doctor`: the environment, and which tiers and techniques work in it, and why not.

Every check reads package metadata (`importlib.metadata`) or looks a module up
(`importlib.util.find_spec`) without importing it; only CUDA's state needs torch itself, and
torch is imported only when it is installed. A user on a launcher's pinned stack learns here,
in one screen, what `predict` can do before asking it.
"""

from __future__ import annotations

import importlib.util
import json
import platform
from dataclasses import asdict, dataclass

import typer

from hybridmem.environment import PRICED_WITH, installed, versions

# The libraries printed: the ones the tiers price with (environment.PRICED_WITH, TRL among
# them: its trainers' step, and the launchers drive them: LLaMA-Factory, axolotl)
SHOWN = PRICED_WITH


@dataclass(frozen=True)
class Check:
    """One row: a tier or technique, whether it works here, and why not (or what it uses)."""

    name: str
    ok: bool
    detail: str


def _has(module: str) -> bool:
    """Whether `module` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _missing(*dists: str) -> list[str]:
    return [d for d in dists if installed(d) is None]


def _needs(name: str, dists: tuple[str, ...], modules: tuple[str, ...], works: str) -> Check:
    """`name` works when every distribution is installed and every module is importable."""
    gone = _missing(*dists)
    if gone:
        return Check(name, False, f"not installed: {', '.join(gone)} "
                     f"(pip install {' '.join(gone)})")
    broken = [m for m in modules if not _has(m)]
    if broken:
        return Check(name, False, f"installed, but {', '.join(broken)} cannot be imported")
    return Check(name, True, works)


def cuda() -> dict:
    """torch's CUDA build and devices, and whether NVML (nvidia-ml-py) is importable."""
    out: dict = {"torch_cuda": None, "available": False, "devices": [],
                 "nvml": _has("pynvml")}
    if installed("torch") is None:
        return out
    import torch

    out["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["available"] = True
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def trace_check() -> Check:
    """The trace tier: torch, transformers and peft installed at the supported floors."""
    from hybridmem.environment import trace_refusal

    why = trace_refusal()
    if why is not None:
        return Check("trace tier", False, why)
    return Check("trace tier", True, "runs the installed transformers "
                 f"{installed('transformers')} / peft {installed('peft')} code")


def learned_check() -> Check:
    """The learned tier: its libraries and at least one trained model in the registry."""
    libs = _needs("learned tier", ("lightgbm", "scikit-learn", "mlflow"), (),
                  "")
    if not libs.ok:
        return Check("learned tier", False, libs.detail.replace(
            "(pip install", "(pip install -e '.[learned]';"))
    from hybridmem.learned.registry import models_root

    root = models_root()
    found = sorted(p.parent.name for p in root.glob("*/metadata.json")) if root.is_dir() else []
    if not found:
        return Check("learned tier", False, f"no trained model under {root} "
                     "(hybridmem train, or set $HYBRIDMEM_MODELS)")
    return Check("learned tier", True, f"models: {', '.join(found)} ({root})")


def checks() -> list[Check]:
    """Every tier and technique, in the order `doctor` prints them."""
    gpu_runs = "; collecting real runs needs a CUDA GPU"
    return [
        Check("analytic tier", True, "closed forms; needs no torch"),
        trace_check(),
        learned_check(),
        _needs("bitsandbytes (--quantize, adamw-8bit)", ("bitsandbytes",), (),
               "installed" + gpu_runs),
        _needs("liger-kernel (--liger)", ("liger-kernel",), ("liger_kernel",),
               "installed" + gpu_runs),
        _needs("cut-cross-entropy (--cut-cross-entropy)", ("cut-cross-entropy",),
               ("cut_cross_entropy",), "installed" + gpu_runs),
        _needs("deepspeed (collect, strategy zero*)", ("deepspeed",), ("deepspeed",),
               "installed" + gpu_runs),
        _needs("ray (collect on a cluster)", ("ray",), ("ray",), "installed"),
        _needs("serve extra (fastapi, uvicorn)", ("fastapi", "uvicorn"), ("fastapi", "uvicorn"),
               "installed"),
    ]


def _emulated_note(c: Check) -> Check:
    """Prediction emulates these kernels (the trace tier needs none of them installed)."""
    emulated = ("bitsandbytes", "liger-kernel", "cut-cross-entropy")
    if not c.ok and c.name.startswith(emulated):
        return Check(c.name, False, c.detail + "; predict emulates it without the package")
    return c


def report() -> dict:
    """The `--json` object: environment, CUDA, and one entry per check."""
    env = {**versions(), **{d: installed(d) for d in SHOWN}, "platform": platform.platform()}
    return {"environment": env, "cuda": cuda(),
            "checks": [asdict(_emulated_note(c)) for c in checks()]}


def doctor_command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
) -> None:
    """Print the environment and which tiers and techniques work here (and why not)."""
    out = report()
    if as_json:
        typer.echo(json.dumps(out, indent=1))
        return
    env, gpu = out["environment"], out["cuda"]
    typer.echo("environment: " + ", ".join(f"{k} {env[k] or '-'}"
                                           for k in ("python", *SHOWN)))
    if gpu["available"]:
        typer.echo(f"CUDA {gpu['torch_cuda']}: " + ", ".join(gpu["devices"]))
    else:
        typer.echo(f"CUDA: none visible (torch built for CUDA {gpu['torch_cuda'] or '-'}); "
                   f"NVML {'importable' if gpu['nvml'] else 'not installed'}")
    width = max(len(c["name"]) for c in out["checks"])
    for c in out["checks"]:
        typer.echo(f"  {'ok ' if c['ok'] else 'no '} {c['name']:<{width}}  {c['detail']}")


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_command)
