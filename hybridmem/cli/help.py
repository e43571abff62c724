"""`hybridmem predict --help` on one screen: one line per option where it fits, in the panels
the options are declared in, option names never cut, and examples at the end.

typer's own rich help gives every option a bordered box cell and wraps each help text in a
narrow column (about 160 lines at 80 columns); this layout gives the name its full width and
the help the rest. What each option means in full, with its choices and the config keys that
set it: README "Options of hybridmem predict" (generated from the same schema).
"""

from __future__ import annotations

import textwrap

from typer.core import TyperCommand, TyperOption

NAME_WIDTH = 30
"""Widest option name with its value placeholder and indent (`--[no-]optimizer-in-backward`):
choices go into the placeholder only within it. Each panel's name column is as wide as its
longest name; the help text gets the rest of the terminal."""
INDENT = 2
MAX_LINES = 2
"""Lines an option's help may take; a longer list of choices is cut, saying how many in all."""
ALL_CHOICES = frozenset({"precision"})
"""Fields whose every choice is listed (one more line): precision decides most verdicts."""
OFF_SCREEN = frozenset({"zero_stage", "beta", "kbit_prep", "sequence_parallel", "cp", "pp",
                        "pp_schedule", "pp_virtual_stages", "pp_microbatches", "ep",
                        "dp_replicate", "dp_shard", "offload_param", "mp_reduce_dtype",
                        "timeline", "cut_cross_entropy", "jobs", "workers",
                        "num_iterations", "padded"})
"""Options the one-screen help leaves to the README: an alias (`--zero-stage N` =
`--strategy zeroN`, `--cut-cross-entropy` = `--loss cce`), GRPO's / DPO's `--beta` (what it
changes, the reference model, is `--ref-model`) and `--num-iterations` (GRPO's passes per
generation, 1 in almost every run), `--no-kbit-prep` (peft's k-bit preparation is
what almost every QLoRA job runs), the model-parallel layout beyond `--tp` (`--pp`,
`--sequence-parallel`, `--cp`, `--ep`, the pipeline schedule and the data-parallel split:
docs/parallel.md), ZeRO-Infinity's `--offload-param`, FSDP2's `--mp-reduce-dtype` (with
`--mp-param-dtype`), the trace tier's `--timeline` and the many-jobs mode (`--jobs FILE.jsonl
--workers N`: the examples' line points at it), and `--padded` (a padded batch's masks; with
`--lengths` each batch decides it from its own padding)."""
LONG_DEFAULT = 24
"""A default longer than this (the LoRA target list) is left to the README."""


def option_name(param: TyperOption, metavar: str | None) -> str:
    """`--name VALUE`, or `--[no-]name` for an on/off flag, `--name` for a plain flag."""
    long = max(param.opts, key=len)
    short = "".join(f"{o}, " for o in param.opts if o != long)  # -v, --verbose
    if param.secondary_opts:
        return "--[no-]" + long[2:]
    if param.is_flag:
        return short + long
    return f"{short}{long} {metavar}" if metavar else short + long


def terse(text: str) -> str:
    """A help text without its parenthetical asides (" (...)"), a "(default: x)" aside kept as
    "[x]": the full text is the README's."""
    out, depth, aside = [], 0, []
    for i, ch in enumerate(text):
        if ch == "(" and (depth or (i and text[i - 1] == " ")):
            depth += 1
        if depth:
            aside.append(ch)
            if ch == ")":
                depth -= 1
                if not depth:
                    inner = "".join(aside)[1:-1]
                    if inner.startswith("default: "):
                        out.append(f"[{inner[len('default: '):]}]")
                    elif out and out[-1] == " ":
                        out.pop()
                    aside = []
            continue
        out.append(ch)
    return "".join(out).strip()


def _field_text(meta, width: int) -> tuple[str | None, str]:
    """(value placeholder, help) of a job-schema option whose help gets `width` columns: the
    choices in the placeholder where they fit, else after the help, as many as fit in
    `MAX_LINES` lines (then how many there are in all)."""
    from hybridmem.job import schema

    choices = [str(c) for c in meta.choices or ()]
    inline = "|".join(choices)
    name = max(meta.cli[0].split("/"), key=len)
    fits = choices and len(name) + 1 + len(inline) <= NAME_WIDTH - INDENT
    metavar = inline if fits else METAVARS.get(meta.key) or ("NAME" if choices else _typed(meta))
    default = schema.default_text(meta)
    tail = (f" [{default}]" if default and default != "none" and len(default) <= LONG_DEFAULT
            and not isinstance(meta.default, bool) else "")
    text = terse(meta.help).rstrip(".")
    if not choices or fits:
        return metavar, text + tail
    lines = MAX_LINES + (meta.name in ALL_CHOICES)
    for n in range(len(choices), 0, -1):
        listed = ", ".join(choices[:n]) + ("" if n == len(choices) else
                                           f", ... ({len(choices)} in all)")
        full = f"{text}: {listed}{tail}"
        if len(textwrap.wrap(full, width)) <= lines:
            return metavar, full
    return metavar, full


METAVARS: dict[str, str] = {"gpu": "NAME", "gpu_mem": "GIB", "method": "TIER", "recipe": "NAME",
                            "zero_stage": "N", "workers": "N", "model": "MODEL", "lora_targets": "NAMES",
                            "image_size": "PIXELS", "lengths": "FILE",
                            "config_format": "NAME"}
"""Value placeholders by parameter name; any other option that is not a job field takes a
FILE, a job field its type's (`_typed`)."""


def _typed(meta) -> str:
    """N for a count, X for another number, VALUE for text (the unit is in the help)."""
    from hybridmem.job import schema

    kind = schema.value_type(schema.TYPES[meta.key])
    return "N" if kind is int else "X" if kind is float else "VALUE"


def rows(command: TyperCommand, width: int = 80) -> list[tuple[str, list[tuple[str, str]]]]:
    """(panel title, [(option name, help)]) in declaration order, `--help` last; `width`: the
    terminal's columns."""
    from hybridmem.job import schema

    panels: dict[str, list] = {}  # panel -> [(param, its job field or None)]
    for param in command.params:
        if not isinstance(param, TyperOption) or param.hidden or param.name in OFF_SCREEN:
            continue
        meta = schema.BY_KEY.get(param.name)
        panel = getattr(param, "rich_help_panel", None) or "Options"
        panels.setdefault(panel, []).append((param, meta if meta is not None and meta.cli
                                             else None))
    out = []
    for panel, params in panels.items():
        named = []
        for param, meta in params:  # the placeholder first: it sets the column's width
            metavar = (_field_text(meta, width)[0] if meta is not None else
                       None if param.is_flag else METAVARS.get(param.name, "FILE"))
            named.append((param, meta, option_name(param, metavar)))
        column = INDENT + max(len(name) for _, _, name in named)
        room = max(width - column - 2, 20)  # each column is padded by one on its right
        options = []
        for param, meta, name in named:
            text = (_field_text(meta, room)[1] if meta is not None else
                    terse(param.help or "").rstrip("."))
            if param.required:
                text += " [required]"
            options.append((name, text))
        out.append((panel, options))
    out = out or [("Options", [])]
    out[-1][1].append(("--help", "Show this message and exit"))
    return out


class CompactHelp(TyperCommand):
    """A typer command whose `--help` is `rows` in two aligned columns, then the epilog, and
    whose plain option values are coerced without pydantic (`cli.coerce`)."""

    def parse_args(self, ctx, args):
        from hybridmem.cli.coerce import install

        install(self.get_params(ctx))
        return super().parse_args(ctx, args)

    def format_help(self, ctx, formatter) -> None:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        console = Console(highlight=False)
        pieces = " ".join(self.collect_usage_pieces(ctx))
        console.print(Text(f"Usage: {ctx.command_path} {pieces}", style="bold"))
        console.print(f"{self.help or ''}", markup=False)
        for panel, options in rows(self, console.width):
            console.print(Text(panel, style="bold"))
            width = INDENT + max(len(name) for name, _ in options)
            table = Table(box=None, show_header=False, padding=(0, 1, 0, 0), pad_edge=False)
            table.add_column(no_wrap=True, width=width)
            table.add_column(overflow="fold")
            for name, text in options:
                table.add_row(Text(" " * INDENT + name, style="cyan"), Text(text))
            console.print(table)
        if self.epilog:
            console.print("\n" + self.epilog, markup=False)
