"""Presentation of a `Prediction`: rich tables for people, a stacked bar chart for reports.

Pure functions of the Prediction; computing never happens here (STYLE.md: gather, then print).
"""

from __future__ import annotations

from pathlib import Path

from hybridmem.categories import CATEGORIES
from hybridmem.notes import hidden_count, shown, tier_line
from hybridmem.prediction import Prediction

GiB = 1024**3
MODULE_COLUMNS: tuple[str, ...] = ("param", "grad", "optimizer", "activation")


def gib(n: int | None) -> str:
    """Bytes as GiB with two decimals (GiB = 2^30, what nvidia-smi's MiB/1024 gives)."""
    return "-" if n is None else f"{n / GiB:,.2f}"


MODULE_LABELS: dict[str, str] = {
    "param": "weights", "grad": "grads", "optimizer": "optimizer",
    "activation": "saved for backward"}
"""Column headers of the module table: a module's own tensors of each category."""
MODULE_TITLE = ("memory by module (GiB): each module's own weights, grads and optimizer state "
                "when all exist, and what it saves for backward; the last rows reconcile the "
                "total with the device peak")
"""What the module table's numbers are: not a snapshot at one moment (the breakdown is)."""


def module_table(pred: Prediction) -> dict:
    """The module table as data (bytes), for the console and the page: per module its own
    tensors (`ModuleMemory`: each category when it exists, not at one moment), then what
    belongs to no module at the device peak (`breakdown`'s other categories), then what of the
    module rows is not alive at the device peak (grads freed or not yet made, activations
    freed, fp32 master grads in their place: the device peak minus the rows above, signed), so
    that the total column sums to `peak.device_bytes`."""
    rows = []
    for m in pred.modules:
        values = {c: getattr(m, c) for c in MODULE_COLUMNS}
        rows.append({"module": m.name, "params": m.params, "trainable": m.trainable_params,
                     **values, "total": sum(values.values())})
    other = {c: v for c, v in pred.breakdown.items() if c not in MODULE_COLUMNS}
    rows.append({"module": "at the device peak, in no module: "
                 + ", ".join(c for c, v in other.items() if v),
                 "total": sum(other.values())})
    rows.append({"module": "module rows not alive at the device peak (-) or beyond them (+)",
                 "total": pred.peak.device_bytes - sum(r["total"] for r in rows)})
    rows.append({"module": f"device peak ({pred.peak.phase}, iteration {pred.peak.iteration})",
                 "total": pred.peak.device_bytes})
    return {"title": MODULE_TITLE, "columns": {"module": "module", "params": "params",
                                               "trainable": "trainable", **MODULE_LABELS,
                                               "total": "total"},
            "rows": rows}


def module_rows(pred: Prediction) -> list[list[str]]:
    """`module_table`'s rows as the console prints them (blank where a row has no value)."""
    table = module_table(pred)
    out = []
    for row in table["rows"]:
        cells = []
        for key in table["columns"]:
            value = row.get(key)
            cells.append(value if key == "module" else "" if value is None
                         else f"{value:,}" if key in ("params", "trainable") else gib(value))
        out.append(cells)
    return out


def smallest_micro_batch(pred: Prediction) -> int:
    """The smallest micro-batch the search probes: 1, or GRPO's whole group of completions
    (`objectives.micro_batch_step`), read from the job echo."""
    from hybridmem import objectives

    job = pred.job or {}
    plugin = objectives.REGISTRY.get(job.get("objective"))
    # a generating objective's micro-batch counts completions in groups of num_generations
    return int(job.get("num_generations") or 1) if plugin and plugin.GENERATES else 1


VERDICT_WORDS: dict[str, str] = {
    "yes": "FITS", "after-retry": "FITS AFTER ALLOCATOR RETRIES", "no": "DOES NOT FIT"}
"""`Prediction.fit` -> the console's verdict word."""


def verdict(pred: Prediction) -> str:
    """One line: the verdict (`Prediction.fit`), with headroom, against the chosen GPU."""
    if pred.fit is None:
        return "no GPU given (use --gpu NAME or --gpu-mem GIB to check the fit)"
    head = pred.headroom_bytes
    rel = head / pred.gpu_memory_bytes * 100
    word = VERDICT_WORDS[pred.fit]
    if pred.within_error:  # `Prediction.within_error`: the headroom is inside the tier's error
        rest = word.removeprefix("FITS").replace(" AFTER", ", AFTER")
        word = f"FITS ONLY WITHIN THE ERROR{rest}; expect OOM risk"
    line = (f"{word} on {pred.gpu_name} ({gib(pred.gpu_memory_bytes)} GiB): "
            f"headroom {gib(head)} GiB ({rel:+.1f}%)")
    if pred.verdict_bytes != pred.peak.device_bytes:  # the learned tier's upper bound decides
        line += f" against the upper bound {gib(pred.verdict_bytes)} GiB"
    if pred.within_error:
        line += f" < the tier's stated error {gib(pred.error_bytes)} GiB"
    if pred.fit == "after-retry":
        line += " - only after the allocator frees its cached blocks and retries (slower steps)"
    if pred.fits and head < 0:  # only the paged optimizer state does not fit (Prediction.fits)
        line += " - the paged optimizer state is partly evicted to host memory (slower steps)"
    return line


def render(pred: Prediction, console=None, verbose: bool = False) -> None:
    """Print the human-readable report with rich: every note with `verbose`, else the few that
    matter (`hybridmem.notes.shown`) and how many more there are."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # pipes and logs: do not truncate module names at 80 cols
            console = Console(width=140)
    if pred.job is not None:  # first: the job that was priced, as the schema names it
        from hybridmem.job.schema import echo_lines

        for line in echo_lines(pred.job):
            console.print(line, highlight=False, markup=False)
    # module rows hold each module's own tensors; the breakdown below is the snapshot at the
    # device peak; `module_table`'s last rows reconcile the two
    table = Table(title=f"{pred.model} — {MODULE_TITLE}", title_justify="left")
    for key, col in module_table(pred)["columns"].items():
        table.add_column(col, justify="left" if key == "module" else "right")
    rows = module_rows(pred)
    for i, row in enumerate(rows):  # a rule above the device-peak row: it is their sum
        table.add_row(*row, end_section=i == len(rows) - 2)
    console.print(table)

    cats = Table(title="breakdown at the device peak (GiB)", title_justify="left")
    cats.add_column("category")
    cats.add_column("GiB", justify="right")
    cats.add_column("share", justify="right")
    total = pred.peak.device_bytes
    for c in CATEGORIES:
        v = pred.breakdown[c]
        cats.add_row(c, gib(v), f"{v / total * 100:.1f}%" if total else "-")
    console.print(cats)
    p = pred.peak
    console.print(f"method: {pred.method}   params: {pred.params_total:,} "
                  f"(trainable {pred.params_trainable:,})")
    console.print(f"peak: allocated {gib(p.allocated_bytes)} GiB, reserved "
                  f"{gib(p.reserved_bytes)} GiB, [bold]device {gib(p.device_bytes)} GiB[/bold] "
                  f"in the {p.phase} phase of iteration {p.iteration}")
    console.print(verdict(pred))
    if pred.max_micro_batch is not None:
        console.print("largest micro-batch that fits: " + (
            f"[bold]{pred.max_micro_batch}[/bold]" if pred.max_micro_batch
            else f"[bold]none[/bold]: micro-batch {smallest_micro_batch(pred)} does not fit"))
    if pred.extras.get("upper_bound_bytes") is not None:
        console.print(f"P95 upper bound: {gib(pred.extras['upper_bound_bytes'])} GiB")
    if "lengths" in pred.extras:  # the run a lengths file makes, in one line
        from hybridmem.batches.run import summary

        console.print(summary(pred.extras["lengths"]), highlight=False, markup=False)
    if verbose:
        lines, more = [tier_line(pred), *pred.notes], 0
    else:
        lines, more = shown(pred), hidden_count(pred)
    for note in lines:
        console.print(f"note: {note}", style="dim", highlight=False, markup=False)
    if more:
        console.print(f"({more} more notes: --verbose)", style="dim", highlight=False)


BAR_HEIGHT_IN = 0.55
"""Figure inches per module bar: horizontal bars put module names (vision_tower,
multi_modal_projector, language_model, ...) on the y axis, one per line, so they never
overlap however many or long they are (x-axis labels of vertical bars would)."""


def figure(pred: Prediction):
    """The matplotlib figure of `plot`: one horizontal stacked bar per module (+ "other" for the
    non-module terms), stacked by category, the GPU's memory as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m.name for m in pred.modules] + ["other"]
    fig, ax = plt.subplots(figsize=(8, 1.6 + BAR_HEIGHT_IN * len(names)))
    lefts = [0.0] * len(names)
    for cat in CATEGORIES:
        if cat in MODULE_COLUMNS:
            vals = [getattr(m, cat) / GiB for m in pred.modules] + [0.0]
        else:
            vals = [0.0] * len(pred.modules) + [pred.breakdown[cat] / GiB]
        if not any(vals):
            continue
        ax.barh(names, vals, left=lefts, label=cat)
        lefts = [b + v for b, v in zip(lefts, vals)]
    if pred.gpu_memory_bytes:
        ax.axvline(pred.gpu_memory_bytes / GiB, color="red", linestyle="--",
                   label=f"{pred.gpu_name} memory")
    # room for the longest bar and the GPU line (bars have no autoscale margin at their ends)
    ax.set_xlim(0, 1.05 * max(lefts + [(pred.gpu_memory_bytes or 0) / GiB]))
    ax.invert_yaxis()  # modules top-down in model order, "other" last
    ax.set_xlabel("GiB at the device peak")
    ax.set_title(f"{pred.model}: {pred.peak.device_bytes / GiB:.2f} GiB peak "
                 f"({pred.peak.phase}, {pred.method})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def plot(pred: Prediction, path: str | Path) -> Path:
    """Write `figure(pred)` as a PNG to `path`."""
    import matplotlib.pyplot as plt

    fig = figure(pred)
    out = Path(path)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def steps_plot(pred: Prediction, path: str | Path) -> Path:
    """With `--lengths`: the per-step reserved bytes (the JSON's `lengths.per_step`, the max of
    each run of steps) beside `path`, as `NAME.steps.EXT`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = pred.extras["lengths"]
    series = info["per_step"]
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.step(series["step"], [v / GiB for v in series["reserved_bytes"]], where="post",
            label="reserved (simulated run)")
    ax.axhline(info["reserved_at_cap_bytes"] / GiB, color="grey", linestyle=":",
               label="every batch at the cap")
    if pred.gpu_memory_bytes:
        ax.axhline(pred.gpu_memory_bytes / GiB, color="red", linestyle="--",
                   label=f"{pred.gpu_name} memory")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GiB")
    ax.set_title(f"{pred.model}: reserved per step over {info['steps']} steps", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out = out.with_name(f"{out.stem}.steps{out.suffix or '.png'}")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
