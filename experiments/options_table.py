"""README's options table of `hybridmem predict`, generated from the job schema.

    python experiments/options_table.py [--no-write]

One table per help panel, in `predict --help` order: each job field (`hybridmem.job.schema`,
declared once on the spec dataclasses) with its option, its name in the `--json` `job` object,
its meaning (the declaration's `doc`, else its help), its default and the config-file keys that
set it; then the options that are not job fields (`hybridmem.cli.predict.OTHER_OPTIONS`); job
fields that no option sets (read from files only) close their group's table. Written between
the `options:start` / `options:end` markers of README.md; tests/test_options_doc.py fails when
the README and the schema disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not whichever is installed
sys.path.insert(0, str(ROOT / "experiments"))
from doc_block import main_for  # noqa: E402

START, END = "<!-- options:start -->", "<!-- options:end -->"
SOURCE_LABELS = {"training_args": "TrainingArguments", "deepspeed": "DeepSpeed",
                 "peft": "adapter_config", "bnb": "BitsAndBytesConfig",
                 "torchtitan": "torchtitan TOML", "megatron": "Megatron-LM"}
HEADER = ("| option (`job` name) | meaning | default | set by these config keys |\n"
          "|---|---|---|---|")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _meaning(doc: str | None, help_: str) -> str:
    return _cell(doc if doc else help_.rstrip("."))


def _keys(meta) -> str:
    return "; ".join(f"{SOURCE_LABELS[source]} " + ", ".join(f"`{k}`" for k in keys)
                     for source, keys in meta.keys.items())


def field_row(meta) -> str:
    from hybridmem.job import schema

    option = " / ".join(f"`{d}`" for d in meta.cli) if meta.cli else "(no option)"
    default = schema.default_text(meta)
    choices = f". One of {', '.join(f'`{c}`' for c in meta.choices)}" \
        if meta.choices and not meta.doc else ""
    name = f"lora.{meta.name}" if meta.owner == "lora" else meta.key  # as in `job`
    return (f"| {option} (`{name}`) | {_meaning(meta.doc, meta.help)}{choices} | "
            f"{f'`{default}`' if default else ''} | {_keys(meta)} |")


def other_row(opt) -> str:
    option = " / ".join(f"`{d}`" for d in opt.decls)
    return f"| {option} | {_meaning(opt.doc, opt.help)} | | |"


def table() -> str:
    from hybridmem.cli.predict import OTHER_OPTIONS, panel_title
    from hybridmem.job import schema
    from hybridmem.job.field import GROUPS

    blocks = []
    for group, metas in schema.by_group().items():
        rows = [field_row(m) for m in metas if m.cli]
        rows += [other_row(o) for o in OTHER_OPTIONS if o.panel == group]
        rows += [field_row(m) for m in metas if not m.cli]
        blocks.append(f"#### {GROUPS[group]}\n\n{HEADER}\n" + "\n".join(rows))
    panels = dict.fromkeys(o.panel for o in OTHER_OPTIONS if o.panel not in GROUPS)
    for panel in panels:
        rows = [other_row(o) for o in OTHER_OPTIONS if o.panel == panel]
        blocks.append(f"#### {panel_title(panel)}\n\n{HEADER}\n" + "\n".join(rows))
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    return main_for(table, ROOT / "README.md", START, END, argv)


if __name__ == "__main__":
    sys.exit(main())
