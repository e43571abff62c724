"""The inputs that are not job fields, declared once: config files, the GPU, the tier, the
output. `hybridmem predict`'s options (`cli/predict.py`), the README options table and the
HTTP body's other keys (`serve/request.py`, its OpenAPI schema and the page) are read from here.

Why here, beside the job schema: a file or GPU option added for one front door used to be
missed by the other (the accelerate config reached `serve` later); one declaration with its
CLI names and its HTTP help says at a glance where each option exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FILES_PANEL = "Config files you already have"
OUTPUT_PANEL = "GPU and output"


@dataclass(frozen=True)
class Option:
    """An input that is not a job field."""

    name: str
    """Parameter name (what `predict_command` receives; the HTTP body's key)."""
    decls: tuple[str, ...]
    """The CLI's option names; () where the CLI has none."""
    type: object
    help: str
    """The CLI's one-line help."""
    panel: str
    """A job group's key (`job.field.GROUPS`: the panel it belongs next to) or a panel title."""
    default: object = None
    doc: str | None = None
    """Longer markdown for the README options table (else `help`)."""
    api: str | None = None
    """The HTTP body key's help (it takes objects and text, never a path); None: not a body key."""


_CONFIG_FORMATS = "llamafactory, axolotl, torchtune or accelerate"

OPTIONS: tuple[Option, ...] = (
    Option("peft_config", ("--peft-config",), Optional[str],
           "PEFT adapter_config.json (LoRA/DoRA: analytic; any other method: trace).",
           "adapters",
           doc="a PEFT `adapter_config.json`: LoRA / DoRA / rsLoRA / `modules_to_save` become "
           "`train=lora` (analytic and trace); any other method (IA3, prompt/prefix/p-tuning, "
           "VeRA, OFT, LoHa, LoKr, AdaLoRA, ...) becomes `train=peft`, priced by the trace "
           "tier, which `predict` then picks without `--method` "
           "([docs/peft.md](docs/peft.md))",
           api="PEFT adapter_config.json (an object, or its JSON text)"),
    Option("quantization_config", ("--quantization-config",), Optional[str],
           "BitsAndBytesConfig JSON (or a config.json carrying quantization_config).",
           "precision", api="BitsAndBytesConfig (an object)"),
    Option("zero_stage", ("--zero-stage",), Optional[int],
           "DeepSpeed ZeRO stage 1, 2 or 3 (= --strategy zeroN).", "parallel"),
    Option("recipe", ("--recipe",), Optional[str],
           "llava-1.5-{pretrain,finetune,finetune-lora} (official LLaVA-1.5 scripts).",
           FILES_PANEL,
           api="llava-1.5-{pretrain,finetune,finetune-lora} (official LLaVA-1.5 scripts)"),
    Option("training_args", ("--training-args",), Optional[str],
           "HF TrainingArguments (or TRL SFTConfig) fields as JSON.", FILES_PANEL,
           doc="HF `TrainingArguments` fields as JSON (`args.to_json_string()`; TRL "
           "`SFTConfig` and LLaVA's extensions too): the keys in the last column set the "
           "job, Trainer's defaults fill the rest (micro-batch 8, `max_grad_norm` 1.0); "
           "a key that is neither read nor a known TrainingArguments field is a warning "
           "naming the nearest known key",
           api="HF TrainingArguments fields (an object)"),
    Option("deepspeed", ("--deepspeed",), Optional[str],
           "DeepSpeed config JSON ('auto' resolved as transformers does).", FILES_PANEL,
           api="DeepSpeed config (an object)"),
    Option("config", ("--config",), Optional[str],
           "Launcher config: YAML, torchtitan TOML, Megatron args.",
           FILES_PANEL,
           doc="a launcher's own training YAML (LLaMA-Factory `llamafactory-cli train`, "
           "axolotl, torchtune recipe configs, accelerate's `accelerate config` file: "
           "distributed_type, mixed_precision, num_processes, fsdp_config / "
           "deepspeed_config; it names no model), read as that launcher reads it: its "
           "defaults where the file is silent, its model (a hub id names its preset), "
           "its `deepspeed` / `fsdp_config`; flags and the other files override it. Every "
           "key is read, known to the launcher, or a warning naming the nearest key. "
           "torchtitan's job TOML (`[parallelism]`, `[training]`, `[activation_checkpoint]`, "
           "`[model]` flavor -> preset) and Megatron-LM's arguments (a file of `--args` or "
           "the launch command) too ([docs/parallel.md](docs/parallel.md))",
           api="a launcher's config as text: LLaMA-Factory / axolotl / torchtune / accelerate "
           "YAML, or a TrainingArguments or DeepSpeed JSON"),
    Option("config_format", ("--config-format",), Optional[str],
           f"{_CONFIG_FORMATS} (default: by keys).", FILES_PANEL,
           api="llamafactory, axolotl, torchtune, accelerate, training_args or deepspeed "
           "(default: from its keys)"),
    Option("jobs", ("--jobs",), Optional[str],
           "Many jobs: a JSONL file, one job per line (the `job` names); answers in order.",
           FILES_PANEL,
           doc="a JSONL file, one job per line with the `job` object's names (an answer's "
           "`job` is a valid line; `gpu`, `gpu_mem`, `method`, `find_max_batch` and the "
           "config files may be set per line; the other options are every line's "
           "defaults): answered in order, priced in `--workers` processes, each job's "
           "error in its own row; `--json` prints one JSON object per line "
           "([docs/many-jobs.md](docs/many-jobs.md))"),
    Option("workers", ("--workers",), Optional[int],
           "With --jobs: worker processes (default: the CPUs available).", FILES_PANEL),
    Option("gpu", ("--gpu",), Optional[str],
           "GPU from the catalogue, e.g. h100-80gb, a100-40gb, h200.", OUTPUT_PANEL,
           doc="catalogue in `hybridmem/gpus.py` (A100 40/80 GB, H100, H200, L40S, RTX "
           "4090, …, each total with its source)",
           api="GPU from the catalogue (GET /v1/gpus), e.g. h100-80gb"),
    Option("gpu_mem", ("--gpu-mem",), Optional[float],
           "GPU memory in GiB (instead of --gpu).", OUTPUT_PANEL,
           api="GPU memory in GiB (instead of gpu)"),
    Option("gpu_count", (), Optional[int], "", OUTPUT_PANEL,
           api="GPUs in the job: the same as world_size"),
    Option("find_max_batch", ("--find-max-batch",), bool,
           "Search the largest micro-batch that fits the GPU.", OUTPUT_PANEL, default=False,
           api="search the largest micro-batch that fits the GPU"),
    Option("layouts", ("--layouts",), bool,
           "List the (dp, tp, pp, cp) layouts of --world-size GPUs that fit --gpu.",
           OUTPUT_PANEL, default=False,
           doc="list every (dp, tp, pp, cp) layout of `--world-size` GPUs the model divides "
           "that fits `--gpu`, by headroom, with each one's per-rank peak (analytic), and "
           "the smallest GPU count (a power of two) with a layout that fits "
           "([docs/parallel.md](docs/parallel.md), \"Advice over layouts\")"),
    Option("method", ("--method",), Optional[str],
           "analytic, trace or hybrid (default: chosen per job).",
           OUTPUT_PANEL,
           doc="`analytic`, `trace` or `hybrid`; default: hybrid when a GPU-calibrated "
           "learned model (shipped with hybridmem, or in `$HYBRIDMEM_MODELS`) applies to "
           "this torch, else analytic; trace for PEFT methods and model families only it "
           "can price. `method` and `method_reason` in the answer say which and why",
           api="analytic, trace or hybrid (default: chosen per job)"),
    Option("as_json", ("--json",), bool,
           "Print one JSON object instead of tables.", OUTPUT_PANEL, default=False,
           doc="print one JSON object (schema below) instead of tables"),
    Option("plot", ("--plot",), Optional[str],
           "Save a stacked bar chart (PNG/SVG/PDF) to FILE.", OUTPUT_PANEL,
           doc="save a stacked bar chart (PNG/SVG/PDF) to FILE; with `--lengths` also the "
           "reserved bytes per step as FILE's name + `.steps`"),
    Option("timeline", ("--timeline",), Optional[str],
           "(trace) Save the memory timeline as JSON or PNG.", OUTPUT_PANEL,
           api="add `timeline`: the trace tier's memory over the allocator's events (the "
           "JSON of the CLI's --timeline FILE.json, at most a few hundred points); "
           "the other tiers draw none and leave it out"),
    Option("every_gpu", (), bool, "", OUTPUT_PANEL, default=False,
           api="add `every_gpu`: the verdict for each GPU in the catalogue"),
    Option("verbose", ("--verbose", "-v"), bool,
           "Print every note, not only the three that matter most.", OUTPUT_PANEL,
           default=False,
           doc="print every note; by default the console shows at most three: the tier "
           "and why, the verdict's caveat, the assumption that changes the answer most "
           "(`--json` keeps them all)"),
)
"""Every non-job input, in the CLI help's order within each panel."""

CLI_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.decls)
"""The `hybridmem predict` options that are not job fields."""

API_FIELDS: dict[str, str] = {o.name: o.api for o in OPTIONS if o.api is not None}
"""HTTP body keys that are not job fields -> their one-line help."""
