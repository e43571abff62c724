"""What a training job is: the `TrainingSpec` every tier takes as input.

Only checks that need no model config live here (choices, signs, impossible pairs); checks
that need the model (image size, LoRA targets, image tokens vs. sequence length) are done when
the model graph is built (`hybridmem.models.build_graph`), still at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal, get_args

from hybridmem.errors import SpecError
from hybridmem.job.field import added_defaults, check_bounds, check_value, job_field
from hybridmem import techniques
from hybridmem.objectives import OBJECTIVES, REF_MODELS, TRAINERS
from hybridmem.job.images import normalize_image_size
from hybridmem.techniques.offload import MODES as OFFLOAD_MODES
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.precision import POLICIES, PrecisionPolicy  # noqa: F401 (read as spec.POLICIES)
from hybridmem.job.precision import AUTOCASTS, check_adapters, fold
from hybridmem.job.precision import DTYPES as PRECISION_DTYPES
from hybridmem.techniques.quantize import COMPUTE_DTYPES as QUANT_COMPUTE_DTYPES
from hybridmem.techniques.quantize import QUANTIZE
from hybridmem.techniques.quantize import STORAGE_DTYPES as QUANT_STORAGE_DTYPES

Precision = Literal["fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed", "bf16-master",
                    "bf16-autocast"]
# one entry per rule of `hybridmem.job.optimizers.OPTIMIZERS` (tests/test_optimizers.py checks)
Optimizer = Literal["adamw", "adamw-fused", "adamw-8bit", "paged-adamw-8bit", "paged-adamw",
                    "sgd", "sgd-momentum", "adafactor", "hf-adafactor", "lion", "lion-32bit",
                    "lion-8bit", "paged-lion", "paged-lion-8bit", "lora-fa"]
Trainable = Literal["full", "llm+projector", "projector", "lora", "peft", "llm"]
Attention = Literal["eager", "sdpa", "flash_attention_2"]
Loop = Literal["trainer", "custom"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
TRAINABLES: tuple[str, ...] = get_args(Trainable)
ATTENTIONS: tuple[str, ...] = get_args(Attention)
LOOPS: tuple[str, ...] = get_args(Loop)
"""`trainer`: only the loss outlives the forward (transformers `Trainer.training_step`);
`custom`: `outputs = model(**batch); outputs.loss.backward()`, the output object (logits
included) lives through backward (huggingface/peft method_comparison/MetaMathQA/run.py)."""

# LoRA on every LLM linear layer except lm_head, as the LLaVA-1.5 finetune_lora recipe does
# (haotian-liu/LLaVA `llava/train/train.py::find_all_linear_names`).
DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)

# Precision/optimizer pairs that no framework offers. (bitsandbytes' 8-bit optimizers do run
# under DeepSpeed's fp32 master weights: with no `optimizer` block in the DeepSpeed config,
# Trainer builds the bnb optimizer and ZeRO wraps it as a client optimizer over the fp32
# partitions, transformers integrations/deepspeed.py `deepspeed_optim_sched`; axolotl's
# zero3_bf16.json runs are launched so with adamw_bnb_8bit.)
INVALID_PAIRS: dict[tuple[str, str], str] = {
    # peft `create_lorafa_optimizer` steps the PeftModel's own named parameters (it pairs
    # lora_A with lora_B by name), not a DeepSpeed group of flat fp32 master copies
    ("bf16-master", "lora-fa"): "LoRA-FA steps the model's own named LoRA parameters",
}

# Optimizers that exist for one `train` mode only: LoRA-FA (peft/optimizers/lorafa.py) freezes
# lora_A and projects lora_B's gradient, so it needs LoRA adapters.
OPTIMIZER_TRAINS: dict[str, str] = {"lora-fa": "lora"}


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(name, value, choices)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(name, value, reason="must be a positive integer")


# Layer-level selective activation checkpointing. `every:N` follows transformers 5.x
# `PreTrainedModel._set_gradient_checkpointing(every_n_layers=N)` (modeling_utils.py): a running
# `layer_index` over the GradientCheckpointingLayer modules of `model.modules()` (vision encoder
# layers, then decoder layers, one count), each checkpointed iff `layer_index % N == 0`.
# (torchtitan's `selective_ac_option="N"`, torchtitan/distributed/activation_checkpoint.py
# `_apply_layer_sac`, counts from 1 and so checkpoints blocks N-1, 2N-1, ...; not followed.)
# `ops`: every layer, op-level selective checkpointing as torchtitan's `_apply_op_sac`
# (hybridmem.techniques.sac: matmul / SDPA outputs saved, except every second mm, the rest recomputed).
CKPT_POLICIES: tuple[str, ...] = ("full", "every:N", "ops")


def ckpt_every(policy: object) -> int:
    """N of a `grad_ckpt_policy` (`full` = 1); anything else is a SpecError."""
    if policy in ("full", "ops"):
        return 1
    if isinstance(policy, str) and policy.startswith("every:"):
        n = policy[len("every:"):]
        if n.isascii() and n.isdigit() and int(n) > 0:
            return int(n)
    raise SpecError("grad_ckpt_policy", policy, CKPT_POLICIES,
                    reason="give full or every:N with N a positive integer")


def ckpt_layer(spec: "TrainingSpec", index: int) -> bool:
    """Whether the `index`-th checkpointable layer (0-based, over the whole model in module
    order: GradientCheckpointingLayer subclasses, the analytic graph's decoder / encoder layers)
    is checkpointed: the one rule of the analytic graph, the trace tier and the CUDA harness."""
    return spec.grad_ckpt and index % ckpt_every(spec.grad_ckpt_policy) == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """LoRA adapters as PEFT builds them (adapter weights in fp32 by default)."""

    r: int = job_field(
        # the rank is at most a layer's in/out features: the widest models are ~2**15 wide
        8, help="LoRA rank.", group="adapters", cli="--lora-r", maximum=1 << 16, keys={
            "peft": ("r",), "training_args": ("lora_r",)})
    """Adapter rank."""
    alpha: float = job_field(
        16.0, help="LoRA alpha (scale alpha / r; no memory effect).", group="adapters",
        cli="--lora-alpha", keys={"peft": ("lora_alpha",), "training_args": ("lora_alpha",)})
    """Scaling numerator (scale = alpha / r); changes no memory, kept for the record."""
    targets: tuple[str, ...] = job_field(
        DEFAULT_LORA_TARGETS, help="Comma-separated module names that get adapters.",
        group="adapters", cli="--lora-targets", keys={"peft": ("target_modules",)},
        doc="module-name suffixes that get adapters (PEFT `target_modules` as a list; a value "
        "with regex characters is one regex, `lora.target_regex`); default: every "
        "LLM linear layer but `lm_head` (`q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
        "down_proj`, LLaVA's `find_all_linear_names`)")
    """Module-name suffixes that get adapters (PEFT `target_modules`)."""
    dropout: float = job_field(
        0.0, help="LoRA dropout (> 0 saves a mask and the dropped input per adapted layer).",
        group="adapters", cli=False, keys={"peft": ("lora_dropout",)})
    """LoRA dropout; > 0 saves a dropout mask and the dropped input per adapted layer."""
    use_dora: bool = job_field(
        False, help="DoRA: a magnitude vector per adapted layer, the weight norm in forward.",
        group="adapters", cli=False, keys={"peft": ("use_dora",)}, added=18)
    """DoRA (PEFT `use_dora`): a trainable magnitude vector per adapted layer and the weight
    norm computed in every forward."""
    use_rslora: bool = job_field(
        False, help="rsLoRA scaling alpha / sqrt(r) (no memory effect).", group="adapters",
        cli=False, keys={"peft": ("use_rslora",)}, added=19)
    """rsLoRA scaling alpha / sqrt(r); changes no memory, kept for the record."""
    modules_to_save: tuple[str, ...] = job_field(
        (), help="Modules trained in full next to the adapters (a trainable copy).",
        group="adapters", cli=False, keys={"peft": ("modules_to_save",)}, added=20)
    """Modules trained in full next to the adapters (PEFT `modules_to_save`: a trainable copy)."""
    target_regex: str | None = job_field(
        None, help="LoRA targets as one regex, full-matched against module names (as PEFT).",
        group="adapters", cli=False, added=51,
        doc="PEFT `target_modules` given as one string: a regular expression that must match "
        "a module's whole name (`re.fullmatch`, peft/utils/other.py "
        "`match_target_against_key`), e.g. axolotl's `lora_target_modules: "
        "'model.language_model.layers.[\\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj'`; "
        "on the command line, a `--lora-targets` value with regex characters (`()[]*+?|\\^$`, "
        "which no module name has) is one")
    """PEFT `target_modules` as a string: a regex full-matched against each module's name
    (peft/utils/other.py `match_target_against_key`); replaces `targets` when set."""

    def __post_init__(self) -> None:
        check_bounds(self, "lora.")
        _check_positive("lora.r", self.r)
        if not self.alpha > 0:
            raise SpecError("lora.alpha", self.alpha, reason="must be > 0")
        if not self.targets:
            raise SpecError("lora.targets", self.targets, DEFAULT_LORA_TARGETS,
                            reason="at least one target module is needed")
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError("lora.dropout", self.dropout, reason="must be in [0, 1)")
        if self.target_regex is not None:
            import re

            try:
                re.compile(self.target_regex)
            except (re.error, TypeError) as err:
                raise SpecError("lora.target_regex", self.target_regex,
                                reason=f"not a regular expression ({err})") from None

    def targets_module(self, name: str) -> bool:
        """Whether PEFT puts an adapter on the module named `name` (its full dotted name in the
        model): a string `target_modules` full-matches the name, a list matches a name or its
        last dotted parts (peft/tuners/tuners_utils.py `check_target_module_exists`)."""
        if self.target_regex is not None:
            import re

            return re.fullmatch(self.target_regex, name) is not None
        return any(name == t or name.endswith("." + t) for t in self.targets)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    """One training configuration whose per-GPU peak memory we predict."""

    model: str = job_field(
        help="Preset name or path to a HF config.json (or its folder).", group="model",
        echo=True,
        doc="preset (`llava-1.5-7b`, `llava-1.5-13b`, `llava-v1.6-mistral-7b`, "
        "`llava-onevision-qwen2-7b-ov-hf`, `qwen2-vl-7b-instruct`, `qwen2.5-vl-7b-instruct`, "
        "`qwen3-vl-8b-instruct`, `qwen3-vl-30b-a3b-instruct`, `idefics3-8b-llama3`, "
        "`mistral-small-3.1-24b-instruct-2503`, `pixtral-12b`, `internvl3-2b-hf`, "
        "`internvl3-8b-hf`, `gemma-3-4b-it`, `llama-3.2-3b`, `qwen2-7b`, `qwen3-8b`, `phi-4`, "
        "`gemma-2-9b`, `mixtral-8x7b-v0.1`, `qwen3-30b-a3b`, `llama-3.1-8b`, `qwen2.5-7b`, "
        "`mistral-7b-v0.3`, `olmo-2-1124-7b`, `tiny-llava`, …; hub ids such as "
        "`meta-llama/Llama-3.1-8B` name their preset, as do their instruct / chat / base / "
        "`-hf` / dated releases (`Qwen/Qwen3-4B-Instruct-2507`) and the `NousResearch/` and "
        "`unsloth/` mirrors (`unsloth/...-bnb-4bit`: NF4 weights); MLX and GGUF conversions "
        "are refused by name (docs/design.md, Job schema); `hybridmem "
        "models` lists every preset with its family, parameter count and tiers) or a path to a "
        "HF `config.json` / its folder; nothing is downloaded. `model_type` `llava` (CLIP, "
        "SigLIP or Pixtral tower), `llava_next`, `llava_onevision`, `llava_next_video`, "
        "`qwen2_vl`, `qwen2_5_vl`, "
        "`qwen3_vl`, `qwen3_vl_moe`, `idefics3`, `smolvlm`, `internvl`, `mistral3`, `gemma3` "
        "(VLMs with their image-token rule, [docs/vlm-families.md](docs/vlm-families.md)) and "
        "`llama`, `mistral`, `qwen2`, `qwen3`, `phi3`, `gemma2`, `gemma3_text`, `mixtral`, "
        "`qwen3_moe`, `olmo2` (decoders, [docs/families.md](docs/families.md); Gemma 2 defaults to "
        "eager attention, the MoE families need full bf16): every tier (closed forms). Any other `model_type` "
        "the installed transformers builds as `AutoModelForCausalLM` or "
        "`AutoModelForImageTextToText` (GPT-2, OPT, PaliGemma, Mllama, …): trace tier only, "
        "which `predict` picks without `--method` (and says so in the notes); `--method "
        "analytic` refuses it in one line; `--method hybrid` answers with the trace tier and "
        "says so. Those VLMs are priced on text-only batches (`--images-per-sample 0`: the "
        "vision tower and projector hold weights but run no forward); the default LoRA targets "
        "are the family's own language-model linears "
        "([docs/trace.md](docs/trace.md#which-models))")
    """Preset name (see `hybridmem.models.PRESETS`) or path to a HF config.json / folder."""
    micro_batch: int = job_field(
        1, help="Samples per GPU per step.", group="batch", unit="samples", feature=True,
        echo=True, keys={"training_args": ("per_device_train_batch_size",),
                         "deepspeed": ("train_micro_batch_size_per_gpu",)},
        doc="the per-GPU batch (a TrainingArguments file without "
        "`per_device_train_batch_size` means Trainer's 8; DeepSpeed's `\"auto\"` takes it "
        "from there)")
    """Samples per GPU per step."""
    seq_len: int = job_field(
        2048, help="Tokens per sample, image tokens included.", group="batch", unit="tokens",
        feature=True, echo=True,
        keys={"training_args": ("model_max_length", "max_seq_length", "max_length")},
        doc="tokens per sample **including image tokens** (as LLaVA's `model_max_length` "
        "counts them; TRL SFTConfig's `max_length`, `max_seq_length` before TRL 0.20, "
        "truncates every sample to it)")
    """Tokens per sample incl. image tokens (LLaVA's `model_max_length` counts both)."""
    images_per_sample: int | None = job_field(
        None, help="Images per sample (default: 1 for multimodal models, 0 for LLMs).",
        group="batch", unit="images",
        doc="default 1 image at the tower's native size for multimodal models, 0 for LLMs")
    """Images per sample; None means 1 for a multimodal model and 0 for a decoder LLM."""
    image_size: int | str | None = job_field(
        None, help="Image side in pixels, or HxW (default: the vision tower's).",
        group="batch", unit="pixels",
        doc="the image side in pixels, default the tower's native size; `--image-size HxW` for "
        "native-resolution families (Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the patch grid, the 2×2 "
        "merge and window attention follow from it; Mistral-3 and pixtral-12b: the input image, "
        "shrunk to the longest edge, default a longest-edge square; "
        "[docs/vlm-families.md](docs/vlm-families.md)) and the image-splitting ones (Idefics3 / "
        "SmolVLM: the tile grid of the resized image, default the size the checkpoint records, "
        "else 4 tiles; InternVL: the 1-12-tile grid of the input image's aspect ratio, plus a "
        "thumbnail, default one tile)")
    """Input image side in pixels, or "HxW" (Qwen2-VL / Qwen2.5-VL: native dynamic
    resolution); None means the vision tower's native size. A square is stored as an int."""
    precision: Precision | None = job_field(
        None, help="Precision shorthand (default: the model's rule).",
        group="precision", choices=PRECISIONS,
        feature=True, echo=True, keys={"training_args": ("bf16", "fp16"),
                                       "deepspeed": ("bf16", "fp16", "bfloat16")},
        doc="`fp32`, `bf16`, `fp16` (pure), `bf16-mixed`, `fp16-mixed` (fp32 params + "
        "autocast), `bf16-master` (bf16 params/grads + fp32 master weights and state), "
        "`bf16-autocast` (bf16 weights under bf16 autocast: Trainer `bf16=True` over a model "
        "loaded with `torch_dtype=bfloat16`; LLaMA-Factory's LoRA and axolotl's `bf16: true`). "
        "TrainingArguments `bf16` / `fp16` are autocast (`bf16-mixed`); DeepSpeed's are "
        "`bf16-master`. Default (`hybridmem.families.defaults`): with adapters (`lora`, `peft`) "
        "the checkpoint's `torch_dtype` as the model is loaded (`bf16`: bf16 weights and "
        "compute, peft's fp32 adapters; float32 or none given: `fp32`); otherwise `bf16-mixed` "
        "(fp32 weights + bf16 autocast, Trainer `bf16=True`). A model loaded with "
        "`torch_dtype=bfloat16`, no autocast: `bf16`. The axes below override it")
    """Where params, grads and optimizer state live (pure, autocast-mixed, master-weights);
    None: the model's default (`hybridmem.families.defaults.resolve_defaults`)."""
    weights_dtype: str | None = job_field(
        None, help="Dtype the model is loaded in (torch_dtype; overrides --precision's).",
        group="precision", choices=PRECISION_DTYPES, added=22,
        doc="the precision as axes (`hybridmem.job.precision.AXES`): the dtype the model is "
        "loaded in; with `--autocast` and `--master-weights` it overrides the `--precision` "
        "shorthand's axes and names one of them (`--weights-dtype bf16` = `bf16`, `--autocast "
        "bf16` alone = `bf16-mixed`); a combination no shorthand names exits 2")
    """The weights' dtype axis; folded into `precision` at construction (then None)."""
    autocast: str | None = job_field(
        None, help="torch.autocast dtype (none: ops run in the weights' dtype).",
        group="precision", choices=AUTOCASTS, added=23,
        doc="torch.autocast's dtype over the step (`none`, `bf16`, `fp16`); overrides "
        "`--precision`'s, as `--weights-dtype`")
    """The autocast axis; folded into `precision` at construction (then None)."""
    master_weights: bool | None = job_field(
        None, help="An fp32 master copy of trained weights (DeepSpeed's bf16 optimizer).",
        group="precision", added=24,
        doc="an fp32 master copy of the trained weights and fp32 optimizer state over bf16 "
        "weights (DeepSpeed's bf16 optimizer, `bf16-master`); overrides `--precision`'s")
    """The master-weights axis; folded into `precision` at construction (then None)."""
    adapter_dtype: str = job_field(
        "fp32", help="LoRA adapters' dtype (fp32: peft's autocast_adapter_dtype=True).",
        group="adapters", choices=PRECISION_DTYPES, added=25, recorded="string",
        doc="dtype of the LoRA adapters: `fp32` (peft's default `autocast_adapter_dtype=True` "
        "casts them up), or the weights' dtype in a pure run (`--precision bf16 --adapter-dtype "
        "bf16`: torchtune's LoRALinear, peft with `autocast_adapter_dtype=False`); params, "
        "grads, optimizer state and the adapters' activations follow it. Plain LoRA only. "
        "Both tiers and the harness")
    """LoRA adapters' dtype (`hybridmem.job.precision.check_adapters`)."""
    optimizer: Optimizer = job_field(
        "adamw", help="Optimizer (adamw: torch's foreach AdamW).", group="precision",
        feature=True, echo=True, keys={"training_args": ("optim", "optim_args"),
                                       "deepspeed": ("optimizer",)},
        doc="`adamw` (foreach), `adamw-fused`, `adamw-8bit`, `paged-adamw-8bit`, `paged-adamw` "
        "(bitsandbytes paged: states of ≥ 10^5 elements in CUDA unified memory, outside the "
        "allocator: `paged_bytes`, in the device peak, never the cause of a does-not-fit), "
        "`sgd`, `sgd-momentum`, `adafactor` (torch), `hf-adafactor` (transformers' Adafactor, "
        "`optim=adafactor`), `lion` (lion-pytorch), `lion-32bit`, `lion-8bit`, `paged-lion`, "
        "`paged-lion-8bit` (bitsandbytes), `lora-fa` (peft `create_lorafa_optimizer`: LoRA-FA, "
        "`lora_A` frozen, AdamW on `lora_B`; `--train lora` only). TrainingArguments' `optim` "
        "names map onto these (`adamw_torch_fused`, `adamw_bnb_8bit`, `paged_adamw_8bit`, "
        "`paged_adamw_32bit`, `lion_8bit`, ...); `galore_*` and names transformers 5.x dropped "
        "are refused in one line (docs/design.md \"Optimizers\"); a DeepSpeed `optimizer` block "
        "is DeepSpeed's FusedAdam / FusedLion")
    """Optimizer; `adamw` is torch's foreach AdamW, the CUDA default; `lora-fa` is peft's
    `create_lorafa_optimizer` (LoRA-FA: lora_A frozen, AdamW on lora_B), train='lora' only."""
    grad_ckpt: bool = job_field(
        False, help="Activation (gradient) checkpointing.", group="savers", feature=True,
        keys={"training_args": ("activation_checkpointing", "gradient_checkpointing")},
        doc="activation (gradient) checkpointing of the decoder / encoder layers, as Trainer "
        "reads `activation_checkpointing` (or the deprecated `gradient_checkpointing`)")
    """Activation (gradient) checkpointing of the decoder / encoder layers (`grad_ckpt_policy`)."""
    grad_ckpt_policy: str = job_field(
        "full", help="Layers checkpointed (every:N: layers 0, N, 2N, ...).",
        group="savers", choices=CKPT_POLICIES, added=6, recorded="string",
        keys={"training_args": ("activation_checkpointing_kwargs",
                                "gradient_checkpointing_kwargs")},
        doc="with `--grad-ckpt`: `full` (default: every decoder / encoder layer) or `every:N` "
        "(layer-level selective checkpointing: the checkpointable layers 0, N, 2N, ... counted "
        "over the whole model in module order, vision encoder layers then decoder layers, as "
        "transformers' `activation_checkpointing_enable(every_n_layers=N)`, which "
        "`activation_checkpointing_kwargs.every_n_layers` sets; the others keep all their saved "
        "tensors). Both tiers and the CUDA harness pick the layers by one rule "
        "(`hybridmem.job.spec.ckpt_layer`). `ops`: op-level selective checkpointing of every "
        "layer as torchtitan's `_apply_op_sac` (matmul / SDPA outputs kept except every second "
        "mm, the rest recomputed; analytic tier without adapters, trace tier for all; "
        "[docs/savers.md](docs/savers.md))")
    """Which layers `grad_ckpt` checkpoints: `full` (every one) or `every:N` (layers 0, N, 2N,
    ... counted over all checkpointable layers in module order; `ckpt_layer`)."""
    train: Trainable = job_field(
        "full", help="Which parameters are trained (peft comes with --peft-config).",
        group="adapters", feature=True, echo=True,
        keys={"training_args": ("tune_mm_mlp_adapter", "lora_enable")},
        doc="`full`, `llm+projector` (LLaVA stage 2), `projector` (stage 1, LLaVA's "
        "`tune_mm_mlp_adapter`), `lora` (`--lora-r`, `--lora-alpha`, `--lora-targets "
        "q_proj,v_proj`; LLaVA's `lora_enable`), `peft` (set by `--peft-config`), `llm` (the "
        "language model only, vision tower and projector frozen: LLaMA-Factory's full "
        "fine-tuning of a VLM by default)")
    """Which parameters are trained."""
    lora: LoraSpec | None = None
    """LoRA settings; required and only meaningful with `train='lora'`."""
    attn: Attention | None = job_field(
        None, help="Attention (default: transformers' pick).",
        group="model", choices=ATTENTIONS, feature=True, echo=True,
        keys={"training_args": ("attn_implementation",)},
        doc="`eager`, `sdpa`, `flash_attention_2` (transformers `attn_implementation`); "
        "default: the one transformers picks for the model (`sdpa`, `eager` where its code "
        "has no SDPA path, e.g. Gemma 2)")
    """Attention implementation (`attn_implementation` in transformers); None: the one
    transformers picks for the model (`hybridmem.families.defaults.resolve_defaults`)."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """Data parallelism; the default is one GPU."""
    loop: Loop = job_field(
        "trainer", help="What outlives the forward: trainer (the loss) or custom (outputs).",
        group="loop", feature=True, added=1, recorded="string",
        doc="`trainer` (default: only the loss outlives the forward, as "
        "`Trainer.training_step`; a TrainingArguments file means it) or `custom` (`outputs = "
        "model(**batch); outputs.loss.backward()`: the output object, logits included, lives "
        "until the next forward returns)")
    """What outlives the forward: `trainer` (the loss only) or `custom` (the whole output)."""
    max_grad_norm: float = job_field(
        0.0, help="clip_grad_norm_ before the step; 0 = off.", group="loop", feature=True,
        added=2, recorded="float64", keys={"training_args": ("max_grad_norm",)},
        doc="`clip_grad_norm_` before the step (foreach norms; 0 = off, the default; a "
        "TrainingArguments file means Trainer's 1.0 unless it says otherwise)")
    """`clip_grad_norm_(max_norm)` before the step (foreach norms); 0 = no clipping."""
    grad_accum: int = job_field(
        1, help="Micro-steps accumulated per optimizer step.", group="batch", unit="steps",
        feature=True, echo=True, added=3, recorded="int64",
        keys={"training_args": ("gradient_accumulation_steps",)},
        doc="N micro-steps accumulating into the grads per optimizer step (the peak over them)")
    """Micro-steps whose gradients accumulate before one optimizer step."""
    empty_cache_steps: int = job_field(
        0, help="torch.cuda.empty_cache() every N steps; 0 = never.",
        group="loop", unit="steps", feature=True, added=5, recorded="int64",
        keys={"training_args": ("torch_empty_cache_steps",)},
        doc="`torch.cuda.empty_cache()` every N steps, where the loop calls it: `trainer` after "
        "the forward (before backward) when `global_step % N == 0` (Trainer's "
        "`torch_empty_cache_steps`), `custom` after `optimizer.step()` when `step % N == 0` "
        "with steps from 1 (the peft MetaMathQA benchmark); 0 = never (default). Changes "
        "reserved memory only; both tiers simulate 2 steps, so under `custom` only N = 1 "
        "empties before the second step, under `trainer` N = 1 empties in both and N >= 2 in "
        "the first")
    """`torch.cuda.empty_cache()` every N optimizer steps, where the loop calls it
    (`empty_cache_at`); 0 = never (Trainer's `torch_empty_cache_steps=None`)."""
    optimizer_in_backward: bool = job_field(
        False, help="Step each parameter inside backward.",
        group="savers", feature=True, added=7, recorded="bool",
        doc="the step fused into backward per parameter, as torchtune's "
        "`register_optim_in_bwd_hooks` (one optimizer per parameter, stepped and zeroed in its "
        "post-accumulate-grad hook): gradients are never all alive, the peak leaves the "
        "optimizer step. Refused (exit 2, one line) with `--grad-accum` > 1, `--max-grad-norm` "
        "> 0, `lora-fa`, `fp16-mixed`, `bf16-master` and any multi-GPU strategy. Both tiers "
        "and the harness; [docs/savers.md](docs/savers.md)")
    """The step fused into backward per parameter (torchtune `optimizer_in_bwd`;
    `hybridmem.techniques.optim_in_backward`): gradients are never all alive at once."""
    loss: str | None = job_field(
        None, help="Loss replacement (--liger, --chunked-ce N, --cut-cross-entropy are its shorthands).",
        group="savers", choices=techniques.LOSS_CHOICES, added=50,
        doc="how the loss is computed, one choice at a time (`hybridmem.techniques`): `none` "
        "(transformers' `ForCausalLMLoss` over the logits), `liger` (= `--liger`), "
        "`chunked-ce` (= `--chunked-ce N`, 8 chunks unless given), `cce` (= "
        "`--cut-cross-entropy`); the three flags are shorthands for it, and two of them at "
        "once exit 2. [docs/loss.md](docs/loss.md)")
    """The loss axis; folded into its shorthand fields at construction (then None)."""
    liger: bool = job_field(
        False, help="Liger kernels (use_liger_kernel=True).", group="savers",
        feature=True, added=14, recorded="bool",
        keys={"training_args": ("use_liger_kernel", "liger_kernel_config")},
        doc="Liger kernels as `use_liger_kernel=True` applies them (fused linear cross-entropy: "
        "no logits; RMSNorm, SwiGLU, RoPE; llama / mistral / qwen2 / LLaVA text models); not "
        "with `--chunked-ce`. [docs/loss.md](docs/loss.md)")
    """Liger kernels as transformers' `use_liger_kernel=True` applies them (fused linear
    cross-entropy, RMSNorm, SwiGLU, RoPE; `hybridmem.techniques.liger`)."""
    chunked_ce: int = job_field(
        0, help="Chunked cross-entropy (torchtune) in N chunks; 0 = off.",
        group="savers", unit="chunks", feature=True, added=15, recorded="int64",
        doc="torchtune's chunked cross-entropy (`CEWithChunkedOutputLoss`): the logits upcast "
        "to fp32 one chunk at a time; 0 = off (default). Not with `--liger`. "
        "[docs/loss.md](docs/loss.md)")
    """Chunked cross-entropy (torchtune `CEWithChunkedOutputLoss`): the logits in N chunks,
    each upcast to fp32 inside the loss; 0 = off (HF's `ForCausalLMLoss`)."""
    cut_cross_entropy: bool = job_field(
        False, help="Cut Cross-Entropy (Apple's cut-cross-entropy): the loss without logits.",
        group="savers", feature=True, added=21, recorded="bool",
        doc="Cut Cross-Entropy as axolotl's `cut_cross_entropy: true` patches it (apple's "
        "`cut-cross-entropy`): no logits, only the log-sum-exp per token; bf16 / fp16 weights; "
        "llama / mistral / qwen2 / LLaVA. Not with `--liger` or `--chunked-ce`. Both tiers and "
        "the harness; [docs/loss.md](docs/loss.md)")
    """Cut Cross-Entropy (`hybridmem.techniques.cce`): the loss from the hidden states and
    lm_head.weight without (N, V) logits."""
    offload_activations: str = job_field(
        "none", help="Activation offload.", group="savers",
        choices=OFFLOAD_MODES, feature=True, added=16, recorded="string",
        keys={"training_args": ("activation_offloading", "activation_checkpointing_kwargs",
                                "gradient_checkpointing_kwargs")},
        doc="saved activations kept in host memory: `all` as TRL SFTConfig "
        "`activation_offloading` (every saved tensor >= 1 KiB except the lm_head's, a 5-tensor "
        "forward stash and a two-node backward buffer stay on the GPU), `ckpt-inputs` as "
        "transformers' checkpointing `offload=True` (`activation_checkpointing_kwargs.offload`: "
        "the checkpointed layers' inputs; needs `--grad-ckpt`). Both tiers and the harness; "
        "[docs/savers.md](docs/savers.md)")
    """Saved activations kept in host memory (`hybridmem.techniques.offload`): `all` (TRL
    `activation_offloading`, the whole step) or `ckpt-inputs` (transformers' checkpointing
    `offload=True`: the checkpointed layers' inputs); `none` keeps them on the GPU."""
    packing: bool = job_field(
        False, help="Padding-free packed batches (TRL padding_free / packing); text-only.",
        group="savers", feature=True, added=17, recorded="bool",
        keys={"training_args": ("padding_free", "packing")},
        doc="padding-free packed batches as TRL's `padding_free` / `packing` collator: the "
        "micro-batch in one row with restarting position ids, no padding; sdpa gets a "
        "block-diagonal L x L mask (and loses GQA-in-SDPA), eager's scores are quadratic in the "
        "packed length, flash_attention_2 runs varlen. Text-only. Both tiers and the harness; "
        "[docs/savers.md](docs/savers.md)")
    """Padding-free packed batches (TRL `padding_free` / `packing`; `hybridmem.techniques.packing`):
    the micro-batch's sequences in one row with restarting position ids, no padding."""
    peft_config: str | None = job_field(
        None, help="Canonical JSON of a non-LoRA PEFT adapter config (from --peft-config).",
        group="adapters", cli=False, added=4)
    """Canonical JSON of a PEFT `adapter_config.json` for a non-LoRA method; needs
    `train='peft'` (LoRA/DoRA configs become `train='lora'` with `lora`)."""
    quantize: str = job_field(
        "none", help="Frozen base weights quantised with bitsandbytes (needs lora or peft).",
        group="precision", choices=QUANTIZE, added=8, recorded="string",
        keys={"bnb": ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "quant_method")},
        doc="the frozen base's linear layers (all but `lm_head`, as transformers' bitsandbytes "
        "integration; `llm_int8_skip_modules` replaces that) stored as bitsandbytes 4-bit "
        "(NF4/FP4, `--quantize` means double quantisation on) or LLM.int8, dequantised per "
        "layer in forward and backward; a `BitsAndBytesConfig` JSON (`--quantization-config`) "
        "or a `quantization_config` inside the model's config.json says the same. With "
        "`--train full` / `llm+projector` exit 2. Both tiers and the harness; "
        "[docs/quantize.md](docs/quantize.md)")
    """Frozen base weights quantised with bitsandbytes: `none`, `nf4`, `fp4` (4-bit, QLoRA) or
    `int8` (LLM.int8); rules in `hybridmem.techniques.quantize`. Needs train lora or peft."""
    quant_double_quant: bool = job_field(
        True, help="4-bit: nested quantisation of the absmax (bnb_4bit_use_double_quant).",
        group="precision", cli=False, added=9, keys={"bnb": ("bnb_4bit_use_double_quant",)})
    """4-bit: `bnb_4bit_use_double_quant` (uint8 absmax + nested state; the QLoRA recipe's
    choice; a BitsAndBytesConfig file without the key gets transformers' default False)."""
    quant_compute_dtype: str | None = job_field(
        None, help="4-bit compute dtype (bnb_4bit_compute_dtype); default: the precision's.",
        group="precision", cli=False, added=10, choices=QUANT_COMPUTE_DTYPES,
        keys={"bnb": ("bnb_4bit_compute_dtype",)})
    """4-bit `bnb_4bit_compute_dtype` (float32, bfloat16, float16); None: the precision's."""
    quant_storage: str = job_field(
        "uint8", help="4-bit storage dtype of the packed weights (bnb_4bit_quant_storage).",
        group="precision", cli=False, added=11, choices=QUANT_STORAGE_DTYPES,
        keys={"bnb": ("bnb_4bit_quant_storage",)})
    """4-bit `bnb_4bit_quant_storage`: dtype of the packed weight tensor."""
    quant_skip: tuple[str, ...] | None = job_field(
        None, help="Modules left unquantised (llm_int8_skip_modules; default: lm_head).",
        group="precision", cli=False, added=12, keys={"bnb": ("llm_int8_skip_modules",)})
    """`llm_int8_skip_modules`: modules left unquantised; None: transformers' default
    (lm_head). Given, it replaces the default (lm_head is then quantised unless listed)."""
    kbit_prep: bool = job_field(
        True, help="With --quantize: peft's kbit preparation ran.",
        group="precision", added=13,
        doc="with `--quantize`: peft's `prepare_model_for_kbit_training` cast the other "
        "weights to fp32 (default on); given without a launcher config or training args, its "
        "`use_gradient_checkpointing=True` default also turns `--grad-ckpt` on unless "
        "`--no-grad-ckpt` is given (the echo says so)")
    """peft `prepare_model_for_kbit_training` applied (fp16/bf16 non-quantised params cast to
    fp32); only read with `quantize`."""
    lengths: str | None = job_field(
        None, help="Per-sample token counts; --seq-len caps them.",
        group="batch", added=26,
        doc="per-sample token counts: one integer per line, or a parquet / JSONL / CSV column "
        "`length`, `num_tokens` or `input_ids` (counted), with an optional image-count column "
        "`num_images` / `images` / `image`. `--seq-len` is then the truncation cap; the run's "
        "batches are built as the sampler and collator below say, each distinct (bucketed) "
        "shape priced and their alloc/free streams replayed in order through the allocator "
        "simulator; the JSON gets a `lengths` object ([docs/lengths.md](docs/lengths.md))")
    """Per-sample token counts (`hybridmem.batches.read`); None: every sample is `seq_len`."""
    pad_to: str = job_field(
        "longest", help="With --lengths: pad each batch to its longest sample or to max_length.",
        group="batch", choices=("longest", "max_length"), added=27, cli=False,
        doc="with `--lengths`: `longest` (the collators' default `padding=True`) or "
        "`max_length` (every batch `seq_len` long)")
    """Padding of a batch (`hybridmem.job.batching`)."""
    pad_multiple: int = job_field(
        0, help="With --lengths: round padded lengths up to a multiple of this (0: off).",
        group="batch", unit="tokens", added=28, cli=False,
        keys={"training_args": ("pad_to_multiple_of",)})
    """`pad_to_multiple_of` of the collator (TRL SFTConfig); 0 = none."""
    sampler: str = job_field(
        "random", help="Sample order with --lengths.", group="batch", cli=False,
        choices=("random", "sequential", "group_by_length"), added=29,
        keys={"training_args": ("train_sampling_strategy", "group_by_length")},
        doc="with `--lengths`: `random` (Trainer's seeded `RandomSampler`, reproduced "
        "exactly), `sequential`, or `group_by_length` (`LengthGroupedSampler`: megabatches of "
        "50 batches sorted by length, the longest first; its permutation draws from torch's "
        "global generator, so the order is the same distribution, not the same draw)")
    """Sample order (`hybridmem.job.batching.SAMPLERS`)."""
    seed: int = job_field(
        42, help="With --lengths: the sampler's seed (TrainingArguments data_seed or seed).",
        group="batch", added=30, cli=False, keys={"training_args": ("seed", "data_seed")},
        maximum=(1 << 64) - 1)  # torch.Generator.manual_seed takes a 64-bit seed
    """Seed of the sampler's generator (`data_seed` when given, else `seed`)."""
    max_steps: int = job_field(
        0, help="Steps priced with --lengths (0: one epoch).", group="batch", cli=False,
        unit="steps", added=31, keys={"training_args": ("max_steps",)})
    """Optimizer steps of the simulated run; 0 = one epoch (TrainingArguments `max_steps=-1`)."""
    drop_last: bool = job_field(
        False, help="With --lengths: drop the last partial batch.", group="batch", added=32,
        cli=False,
        keys={"training_args": ("dataloader_drop_last",)})
    """`dataloader_drop_last`."""
    padded: bool = job_field(
        False, help="The batch carries padding (samples shorter than the batch's longest).",
        group="batch", added=54,
        doc="the collator pads the batch (`DataCollatorForLanguageModeling` / "
        "`DataCollatorForSeq2Seq` / `DataCollatorWithPadding` on samples of varied lengths, "
        "or `pad_to_multiple_of`): its attention mask has zeros, so masking_utils builds the "
        "(b, 1, s, s) boolean mask and each layer's sdpa converts it to the query's dtype and "
        "saves it. With `--lengths` each batch's own padding decides (this field is then the "
        "priced batch's); TRL's trainers always pad. [docs/lengths.md](docs/lengths.md)")
    """The batch's attention mask has padding (`hybridmem.batches.steps`: set per batch from
    the lengths); False: every sample is `seq_len` long (no mask is built)."""
    objective: str = job_field(
        "sft", help="Trainer.",
        group="objective", choices=OBJECTIVES, added=33, echo=True, recorded="string",
        keys={"training_args": ("num_generations", "desirable_weight", "undesirable_weight",
                                "center_rewards_coefficient", "rpo_alpha", "loss_type")},
        doc="`sft` (the LM loss), `dpo`, `orpo`, `kto`, `rm` (reward model: a scalar head), "
        "`grpo`, as TRL's trainers run their step: DPO / ORPO / RM put chosen and rejected in "
        "one batch of 2 x micro-batch, DPO / KTO (and GRPO with beta > 0) add a reference "
        "model's forward, GRPO generates first. A TRL config JSON says which by its keys "
        "(`num_generations`: GRPO, `desirable_weight`: KTO, `center_rewards_coefficient`: "
        "RM, `rpo_alpha` / `loss_type`: DPO, else `beta`: ORPO). Both tiers; "
        "[docs/objectives.md](docs/objectives.md)")
    """Training objective (`hybridmem.objectives`): sft, dpo, orpo, kto, rm or grpo."""
    trainer: str = job_field(
        "transformers", help="SFT by Trainer or SFTTrainer (TRL).",
        group="objective", choices=TRAINERS, added=52,
        keys={"training_args": ("dataset_text_field", "completion_only_loss",
                                "assistant_only_loss", "dataset_kwargs")},
        doc="who runs the `sft` step: `transformers` (`Trainer`, the full logits into "
        "`ForCausalLMLoss`) or `trl` (`SFTTrainer`; from TRL 1.15 its fused, chunked LM head, "
        "`trl/kernels/chunked_logprob.py`: no full logits). The other objectives are TRL's "
        "trainers whatever it says; an SFTConfig JSON (its dataset keys) means `trl`. "
        "[docs/objectives.md](docs/objectives.md)")
    """Who runs the SFT step (`objectives.TRAINERS`); the other objectives are TRL's."""
    ref_model: str | None = job_field(
        None, help="Ref.", group="objective", choices=REF_MODELS, added=34,
        keys={"training_args": ("precompute_ref_log_probs",)},
        doc="where the reference log-probs come from: `separate` (a frozen copy of the model "
        "in its dtype), `adapter` (the policy under peft's `disable_adapter()`), `precomputed` "
        "(TRL `precompute_ref_log_probs`: no reference in the step), `none`; default as TRL: "
        "DPO / KTO `adapter` with LoRA / PEFT, else `separate`; GRPO `none` at beta 0; "
        "ORPO / RM / SFT `none`")
    """Reference model (`objectives.ref_model_of` resolves None as TRL does)."""
    beta: float | None = job_field(
        None, help="The loss's beta (GRPO: 0 = no reference).", group="objective",
        added=35, keys={"training_args": ("beta",)},
        doc="the objective's beta; memory only through GRPO's reference (beta 0, TRL's "
        "default, loads none); default: the trainer's (DPO / ORPO / KTO 0.1, GRPO 0.0)")
    """KL / preference coefficient; None: the trainer's default (each objective's `DEFAULT_BETA`)."""
    num_generations: int = job_field(
        8, help="GRPO completions per prompt.",
        group="objective", unit="sequences", added=36, recorded="int64",
        keys={"training_args": (
            "num_generations",)},
        doc="GRPO's completions per prompt (TRL default 8). As in TRL, `--micro-batch` counts "
        "completions (`per_device_train_batch_size`), so the groups only set which batches are "
        "valid: micro-batch x grad-accum x GPUs must be a multiple of it")
    """GRPO completions per prompt (TRL `num_generations`)."""
    max_prompt_length: int | None = job_field(
        None, help="GRPO prompt tokens.", group="objective",
        unit="tokens", added=37, keys={"training_args": ("max_prompt_length",)},
        doc="GRPO's prompt tokens: its sequence is `max_prompt_length + "
        "max_completion_length`, which must be `--seq-len`; read, with no memory effect, for "
        "the preference objectives (TRL truncates prompts to it: the worst case, every "
        "position in the completion, is priced)")
    """Prompt tokens (TRL `max_prompt_length`); None: 0 for the preference objectives, the rest
    of seq_len for GRPO."""
    max_completion_length: int | None = job_field(
        None, help="GRPO tokens generated per completion.",
        group="objective", unit="tokens", added=38,
        keys={"training_args": ("max_completion_length",)},
        doc="GRPO's generated tokens per completion (TRL default 256), the end of each "
        "`--seq-len` sequence")
    """GRPO completion tokens (TRL `max_completion_length`); None: 256."""
    num_iterations: int = job_field(
        1, help="GRPO optimisation passes per generation.", group="objective",
        unit="passes", added=53, maximum=1024,  # TRL's default 1, the GRPO paper's mu 1-4 keys={"training_args": ("num_iterations",)},
        doc="GRPO's passes over each generated batch (TRL `num_iterations`, default 1); above "
        "1 the generation phase also computes the old policy's per-token log-probs under "
        "no_grad and keeps them through the step")
    """GRPO passes per generation (TRL `num_iterations`, the paper's mu)."""
    vllm_gpu_memory_utilization: float = job_field(
        0.0, help="vLLM colocated: its GPU memory fraction.",
        group="objective", added=39, keys={"training_args": (
            "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization")},
        doc="GRPO with vLLM colocated (TRL `use_vllm=True, vllm_mode=\"colocate\"`): vLLM "
        "pre-allocates this fraction of the GPU's memory for its weights and KV cache (TRL "
        "default 0.3); 0 = generation by the policy's own `generate()` (TRL's default); needs "
        "`--gpu` to price")
    """vLLM colocated: fraction of GPU memory it reserves (0 = no vLLM on this GPU)."""

    def __post_init__(self) -> None:
        self._check_values()
        self._fold_shorthands()
        self._check_rules()

    def _check_values(self) -> None:
        """Each field on its own: the schema's bounds, then the shapes and the choices."""
        check_bounds(self)  # first: no check below may loop or allocate on 10**20
        if not isinstance(self.model, str) or not self.model.strip():
            raise SpecError("model", self.model, reason="give a preset name or a config path")
        _check_positive("micro_batch", self.micro_batch)
        _check_positive("num_iterations", self.num_iterations)
        _check_positive("seq_len", self.seq_len)
        if self.images_per_sample is not None and (
            isinstance(self.images_per_sample, bool) or not isinstance(self.images_per_sample, int)
            or self.images_per_sample < 0
        ):
            raise SpecError("images_per_sample", self.images_per_sample,
                            reason="must be a non-negative integer")
        if self.image_size is not None:  # "HxW" / int, stored as an int for a square
            object.__setattr__(self, "image_size", normalize_image_size(self.image_size))
            if isinstance(self.image_size, str):  # each side within the field's bound
                meta = self.__dataclass_fields__["image_size"].metadata["job"]
                for side in self.image_size.split("x"):
                    check_value(meta, int(side), "image_size")
        if self.precision is not None:  # None: resolved per model (families.defaults)
            _check_choice("precision", self.precision, PRECISIONS)

    def _fold_shorthands(self) -> None:
        """The axes given one by one stored as their shorthand fields (precision, the loss)."""
        # the axes given one by one name a shorthand (job.precision.fold); stored as it
        object.__setattr__(self, "precision", fold(self.precision, self.weights_dtype,
                                                   self.autocast, self.master_weights))
        for axis in ("weights_dtype", "autocast", "master_weights"):
            object.__setattr__(self, axis, None)
        # the loss axis names its shorthand field (hybridmem.techniques.fold_loss)
        for name, value in techniques.fold_loss(self.loss, self.liger, self.chunked_ce,
                                                self.cut_cross_entropy).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "loss", None)

    def _check_rules(self) -> None:
        """The rules between fields: choices, pairs, what each setting needs, then each
        technique's and the objective's own checks."""
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("trainer", self.trainer, TRAINERS)
        _check_choice("train", self.train, TRAINABLES)
        if self.attn is not None:  # None: resolved per model (families.defaults)
            _check_choice("attn", self.attn, ATTENTIONS)
        if (self.precision, self.optimizer) in INVALID_PAIRS:
            raise SpecError("optimizer", self.optimizer,
                            [o for o in OPTIMIZERS if (self.precision, o) not in INVALID_PAIRS],
                            reason=f"not available with precision={self.precision!r}: "
                            + INVALID_PAIRS[(self.precision, self.optimizer)])
        if self.train == "lora" and self.lora is None:
            object.__setattr__(self, "lora", LoraSpec())
        if self.train != "lora" and self.lora is not None:
            raise SpecError("lora", "set", reason=f"LoRA settings need train='lora', not {self.train!r}")
        if self.optimizer in OPTIMIZER_TRAINS and self.train != OPTIMIZER_TRAINS[self.optimizer]:
            raise SpecError("optimizer", self.optimizer,
                            [o for o in OPTIMIZERS if o not in OPTIMIZER_TRAINS],
                            reason=f"needs train={OPTIMIZER_TRAINS[self.optimizer]!r}, "
                            f"not {self.train!r}")
        if self.optimizer == "lora-fa" and self.lora.use_dora:
            # lorafa.py pairs every name containing "lora" two by two (A, B): DoRA's
            # lora_magnitude_vector would be paired with the next layer's lora_A
            raise SpecError("optimizer", self.optimizer,
                            [o for o in OPTIMIZERS if o not in OPTIMIZER_TRAINS],
                            reason="LoRA-FA cannot step DoRA (peft pairs lora_* tensors A, B)")
        _check_choice("loop", self.loop, LOOPS)
        ckpt_every(self.grad_ckpt_policy)  # the syntax
        if self.grad_ckpt_policy != "full" and not self.grad_ckpt:
            raise SpecError("grad_ckpt_policy", self.grad_ckpt_policy, CKPT_POLICIES,
                            reason="needs grad_ckpt (--grad-ckpt)")
        if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)) \
                or not self.max_grad_norm >= 0:
            raise SpecError("max_grad_norm", self.max_grad_norm, reason="must be >= 0 (0 = off)")
        _check_positive("grad_accum", self.grad_accum)
        if isinstance(self.empty_cache_steps, bool) or not isinstance(self.empty_cache_steps, int) \
                or self.empty_cache_steps < 0:
            raise SpecError("empty_cache_steps", self.empty_cache_steps,
                            reason="must be a non-negative integer (0 = never)")
        from hybridmem.job import batching
        batching.check(self)
        if self.train == "peft" and not self.peft_config:
            raise SpecError("peft_config", self.peft_config,
                            reason="train='peft' needs a PEFT adapter config (--peft-config FILE)")
        if self.train != "peft" and self.peft_config is not None:
            raise SpecError("peft_config", "set",
                            reason=f"a non-LoRA PEFT config needs train='peft', not {self.train!r}")
        if isinstance(self.quant_skip, list):
            object.__setattr__(self, "quant_skip", tuple(self.quant_skip))
        # before the adapters' checks, which read it (`techniques.check` below runs it again
        # among the others; it is idempotent)
        from hybridmem.techniques.quantize import check as check_quantize

        check_quantize(self)

        check_adapters(self.adapter_dtype, self.precision, self.train,
                       bool(self.lora and self.lora.use_dora), self.quantize)
        techniques.check(self)  # each technique's rules, and one loss replacement at a time
        from hybridmem import objectives

        objectives.check(self)  # the objective's fields and its trainer's rules
        techniques.check_objective(self)  # the techniques priced with that objective

    def with_(self, **changes: object) -> "TrainingSpec":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain, JSON-ready dict (nested specs as dicts, tuples as lists).

        Fields added after the dataset's first rows (`ADDED_DEFAULTS`) are left out while at
        their default, so a spec that does not use them keeps its `spec_hash` and `--resume`
        does not measure it again."""
        out: dict = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (LoraSpec, ParallelSpec)):
                v = {g.name: (list(x) if isinstance(x := getattr(v, g.name), tuple) else x)
                     for g in fields(v)
                     if not (g.name in ADDED_DEFAULTS and getattr(v, g.name) == ADDED_DEFAULTS[g.name])}
            elif f.name in ADDED_DEFAULTS and v == ADDED_DEFAULTS[f.name]:
                continue
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "TrainingSpec":
        """Inverse of `to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError("spec", unknown[0], sorted(known), reason="unknown field")
        data = dict(data)
        if isinstance(data.get("lora"), dict):
            lora = dict(data["lora"])
            for key in ("targets", "modules_to_save"):
                if key in lora:
                    lora[key] = tuple(lora[key])
            data["lora"] = LoraSpec(**lora)
        if isinstance(data.get("parallel"), dict):
            data["parallel"] = ParallelSpec(**data["parallel"])
        return cls(**data)


# Spec and LoRA fields added after the first dataset rows, with their defaults (see `to_dict`):
# the fields declared with `added=`.
ADDED_DEFAULTS: dict[str, object] = added_defaults(TrainingSpec, LoraSpec, ParallelSpec)


EmptyCacheAt = Literal["after_forward", "after_step"]
EMPTY_CACHE_PLACES: tuple[str, ...] = get_args(EmptyCacheAt)


def empty_cache_at(spec: TrainingSpec, iteration: int) -> EmptyCacheAt | None:
    """Where iteration `iteration` (0-based optimizer steps) calls `torch.cuda.empty_cache()`,
    or None: the one rule the analytic stream, the trace runner and the CUDA harness follow.

    `loop="trainer"`: transformers `Trainer.training_step` (trainer.py, 5.x) calls
    `clear_device_cache()` right after `compute_loss` returns and before the loss is divided
    and `accelerator.backward(loss)` runs, when `state.global_step % torch_empty_cache_steps
    == 0`; `global_step` counts finished optimizer steps (from 0) and does not move within an
    accumulation window, so "after_forward" applies to every micro-step of that iteration.
    `loop="custom"`: huggingface/peft method_comparison/MetaMathQA/run.py calls
    `empty_cache()` at the end of the loop body, `if step % N == 0` with `step` from 1, i.e.
    after `optimizer.step()` and before the next iteration's `zero_grad()` (grads and the
    output object still alive): "after_step" when `(iteration + 1) % N == 0`.
    """
    n = spec.empty_cache_steps
    if not n:
        return None
    if spec.loop == "trainer":
        return "after_forward" if iteration % n == 0 else None
    return "after_step" if (iteration + 1) % n == 0 else None
