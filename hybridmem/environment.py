"""The library versions an answer was priced with, read from the installed metadata.

`importlib.metadata` reads each distribution's METADATA file: no import of torch or
transformers, so the analytic tier stays as fast as without it."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

# the libraries whose code the trace tier runs (torch, transformers, peft; trl's fused LM head
# when installed, `objectives.fused_head`); docs/trace.md, "Versions"
PRICED_WITH = ("torch", "transformers", "peft", "trl")


def installed(dist: str) -> str | None:
    """`dist`'s installed version, None when it is not installed."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """{"python": ..., "torch": ..., "transformers": ..., "peft": ...} (`--json` environment)."""
    return {"python": platform.python_version(), **{d: installed(d) for d in PRICED_WITH}}


# The oldest releases the trace tier runs on, the floors in pyproject.toml: the newest
# transformers / peft LLaMA-Factory's current release admits (its pyproject.toml,
# `transformers>=4.49.0,<=4.57.1`, `peft>=0.14.0,<=0.17.1`), tested in CI's compat pass
# (.ci/run); older ones lack `masking_utils` (< 4.53) or build the step differently
# (docs/trace.md, "Versions")
TRACE_FLOORS = {"transformers": "4.57.1", "peft": "0.17.1"}
# The oldest releases of the libraries the oracle tests run but the tiers do not need (the
# test extra's floors in pyproject.toml, installed in CI's compat pass): TRL 1.16.0 is the
# first whose fused LM head runs without Triton (1.15.0's trl/kernels/chunked_logprob.py
# imports triton at module level: no CPU run), which tests/test_trl_oracle.py runs on CPU
ORACLE_FLOORS = {"trl": "1.16.0"}


def release(v: str) -> tuple[int, ...]:
    """The numeric release of a version string ('4.57.1' -> (4, 57, 1); '2.13.0+cpu' ->
    (2, 13, 0); a pre-release tag ends the release)."""
    import re

    out = []
    for part in v.split("+")[0].split("."):
        lead = re.match(r"\d+", part)
        if lead is None:
            break
        out.append(int(lead.group()))
        if lead.end() < len(part):
            break
    return tuple(out)


def major(dist: str) -> int | None:
    """`dist`'s installed major version (metadata only), None when it is not installed."""
    have = installed(dist)
    return release(have)[0] if have else None


def trace_refusal() -> str | None:
    """Why the trace tier cannot run with the installed libraries (one line naming the
    version needed), or None when it can."""
    for dist in ("torch", *TRACE_FLOORS):
        have = installed(dist)
        if have is None:
            return f"{dist} is not installed (pip install -e . installs it)"
        floor = TRACE_FLOORS.get(dist)
        if floor is not None and release(have) < release(floor):
            return (f"needs {dist}>={floor}, installed {have} "
                    f"(pip install '{dist}>={floor}')")
    return None
