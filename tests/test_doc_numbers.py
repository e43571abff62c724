"""Every number README.md and docs/*.md quote from the code is recomputed here and compared with
the text, parsed out of the doc: editing either the code or the doc without the other fails.

Numbers that are measurements (timings, published benchmark values, tier-vs-tier runs) are not
recomputed; the doc names the experiments/ script that produced them. The accuracy section
between the README's `accuracy:published` markers is checked by tests/test_accuracy_docs.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridmem.cli import main

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
MiB = 2**20
RECIPE = ["predict", "--recipe", "llava-1.5-finetune", "--model", "llava-1.5-7b",
          "--gpu", "a100-40gb", "--json"]
"""The README's and docs/parallel.md's multi-GPU example, as the docs write it (plus --json)."""


def text(name: str) -> str:
    return (ROOT / name).read_text()


def quoted(doc: str, pattern: str) -> tuple[str, ...]:
    """The groups of `pattern` in `doc` (one match required: a missing sentence fails too)."""
    found = re.findall(pattern, text(doc), flags=re.S)
    assert len(found) == 1, f"{doc}: expected one match of {pattern!r}, got {found}"
    return found[0] if isinstance(found[0], tuple) else (found[0],)


def gib(value: float, decimals: int) -> str:
    return f"{value / GiB:.{decimals}f}"


@pytest.fixture(scope="module")
def recipe() -> dict:
    """`hybridmem predict ... --json` of the example (analytic tier, ~9 s with the fit advice)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(RECIPE) in (0, None)
    return json.loads(out.getvalue())


def test_readme_multi_gpu_example(recipe):
    device, world, over = quoted("README.md", r"The first answers ([\d.]+) GiB per GPU on (\d+) "
                                              r"GPUs.*?A100-40GB, ([\d.]+) GiB over")
    assert device == gib(recipe["peak"]["device_bytes"], 1)
    assert int(world) == recipe["world_size"]
    assert recipe["advice"]["fits_as_is"] is False
    assert over == gib(-recipe["advice"]["current"]["headroom_bytes"], 1)
    gpus, per_gpu, batch, per_gpu_batch = quoted(
        "README.md", r"here (\d+) GPUs \(([\d.]+) GiB per GPU\) or micro-batch (\d+) \(([\d.]+) GiB")
    fit = recipe["advice"]
    assert (int(gpus), per_gpu) == (fit["world_size"]["world_size"],
                                    gib(fit["world_size"]["peak_bytes"], 1))
    assert (int(batch), per_gpu_batch) == (fit["micro_batch"]["micro_batch"],
                                           gib(fit["micro_batch"]["peak_bytes"], 1))


ROWS = {"param": "param", "grad": "grad", "optimizer": "optimizer", "activation": "activation",
        "temporary": "temporary"}


def test_parallel_md_breakdown_table(recipe):
    bd = recipe["breakdown"]
    for label in ROWS:
        (value,) = quoted("docs/parallel.md", rf"\n\| {label}[^|]*\| ([\d.]+) \|")
        assert value == gib(bd[ROWS[label]], 2), label
    triple = quoted("docs/parallel.md", r"\| workspace / context \(\+ NCCL\) / fragmentation \| "
                                        r"([\d.]+) / ([\d.]+) / ([\d.]+) \|")
    assert triple == tuple(gib(bd[c], 2) for c in ("workspace", "context", "fragmentation"))
    phase, iteration, device, capacity, verdict, headroom = quoted(
        "docs/parallel.md", r"\*\*device peak\*\* \((\w+), iteration (\d+)\) \| \*\*([\d.]+)\*\* "
                            r"of ([\d.]+) → (fits|does not fit), ([+-][\d.]+) GiB")
    peak = recipe["peak"]
    assert (phase, int(iteration), device) == (peak["phase"], peak["iteration"],
                                               gib(peak["device_bytes"], 2))
    assert capacity == gib(recipe["advice"]["gpu_memory_bytes"], 1)
    assert verdict == ("fits" if recipe["advice"]["fits_as_is"] else "does not fit")
    assert headroom == f"{recipe['advice']['current']['headroom_bytes'] / GiB:+.1f}"
    (single,) = quoted("docs/parallel.md", r"One GPU would need ([\d.]+) GiB")
    assert single == gib(recipe["single_gpu_device_bytes"], 1)
    gpus, per_gpu, batch, per_batch = quoted(
        "docs/parallel.md", r"smallest world size, (\d+) GPUs \(([\d.]+) GiB per GPU\), or the "
                            r"largest\s+micro-batch, (\d+) \(([\d.]+) GiB")
    fit = recipe["advice"]
    assert (int(gpus), per_gpu, int(batch), per_batch) == (
        fit["world_size"]["world_size"], gib(fit["world_size"]["peak_bytes"], 1),
        fit["micro_batch"]["micro_batch"], gib(fit["micro_batch"]["peak_bytes"], 1))


def test_quoted_default_overheads_are_the_code_constants():
    from hybridmem.allocator.overheads import (CUBLAS_HANDLES_TRAINING, CUDA_CONTEXT_DEFAULT,
                                              WORKSPACE_32MIB)
    from hybridmem.parallel import estimate as par

    context, handles, workspace, nccl = quoted(
        "README.md", r"CUDA context \((\d+) MiB\) and cuBLAS workspaces \((\d+) × (\d+) MiB, "
                     r"Hopper\).*?NCCL buffers are a nominal (\d+) MiB")
    assert int(context) * MiB == CUDA_CONTEXT_DEFAULT
    assert int(handles) == CUBLAS_HANDLES_TRAINING
    assert int(workspace) * MiB == WORKSPACE_32MIB
    assert int(nccl) * MiB == par.NCCL_BYTES
    buff, channels, peers, total = quoted(
        "docs/parallel.md", r"nominal (\d+) MiB × (\d+) channels × (\d+) ring peers = (\d+) MiB")
    assert (int(buff) * MiB, int(channels), int(peers), int(total) * MiB) == (
        par.NCCL_BUFFSIZE, par.NCCL_CHANNELS, par.NCCL_RING_PEERS, par.NCCL_BYTES)
    (trace_ws,) = quoted("docs/trace.md", r"cuBLAS workspaces \((\d+) MiB each on Hopper")
    assert int(trace_ws) * MiB == WORKSPACE_32MIB
    (trace_context,) = quoted("docs/trace.md", r"CONTEXT_BYTES`,\s+(\d+) MiB, the same default")
    assert int(trace_context) * MiB == CUDA_CONTEXT_DEFAULT


def _cli_json(args: list[str]) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*args, "--json"])
    return json.loads(out.getvalue())


def _worked_example_commands() -> list[list[str]]:
    """The README's objectives worked example, its three commands as written there."""
    import shlex

    part = text("README.md").split("Worked example, Qwen2.5-7B", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)```", part, flags=re.S)[:2]
    cmds = [c for b in blocks for c in b.replace("\\\n", " ").strip().splitlines()]
    return [shlex.split(c)[1:] for c in cmds]


def test_readme_objectives_worked_example():
    """README "Preference and RL fine-tuning": DPO with a separate vs adapter-disabled
    reference on an RTX 4090, GRPO with vLLM colocated on an H100 (analytic tier)."""
    separate_cmd, adapter_cmd, grpo_cmd = _worked_example_commands()
    copy, sep, adapter, batch = quoted(
        "README.md", r"separate reference \(a frozen bf16 copy, ([\d.]+) GiB\) the step needs "
                     r"([\d.]+) GiB: it does\s+not fit.*?it needs ([\d.]+) GiB and\s+the largest "
                     r"micro-batch that fits is (\d+)")
    s = _cli_json(separate_cmd)
    ref = next(m for m in s["modules"] if m["name"] == "reference")
    assert (copy, sep) == (gib(ref["param"], 2), gib(s["peak"]["device_bytes"], 2))
    assert s["fits"] is False
    a = _cli_json(adapter_cmd)
    assert (adapter, int(batch)) == (gib(a["peak"]["device_bytes"], 2), a["max_micro_batch"])
    assert a["fits"] is True
    device, vllm, gen, grpo_batch, n_fit, n_fit_gib, n_over, n_over_gib = quoted(
        "README.md", r"It needs ([\d.]+) GiB on the device, of which vLLM's reservation is "
                     r"([\d.]+) GiB.*?own peak ([\d.]+) GiB; the largest micro-batch that\s+"
                     r"fits is (\d+).*?that fits is (\d+)\s+\(([\d.]+) GiB\); (\d+) needs "
                     r"([\d.]+) GiB")
    g = _cli_json(grpo_cmd)
    assert (device, vllm, gen) == (gib(g["peak"]["device_bytes"], 2),
                                   gib(g["objective"]["vllm_bytes"], 2),
                                   gib(g["objective"]["generation_peak_bytes"], 2))
    assert int(grpo_batch) == g["max_micro_batch"]
    assert int(n_over) == int(n_fit) + 1
    at = grpo_cmd.index("--micro-batch") + 1
    for n, quoted_gib, fits in ((n_fit, n_fit_gib, True), (n_over, n_over_gib, False)):
        args = [a for a in grpo_cmd if a != "--find-max-batch"]
        args[at] = n
        args[args.index("--num-generations") + 1] = n
        p = _cli_json(args)
        assert (quoted_gib, p["fits"]) == (gib(p["peak"]["device_bytes"], 2), fits)
