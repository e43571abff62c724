"""What a training job is: the `TrainingSpec` every tier takes as input.

Only checks that need no model config live here (choices, signs, impossible pairs); checks
that need the model (image size, LoRA targets, image tokens vs. sequence length) are done when
the model graph is built (`hybridmem.models.build_graph`), still at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal, get_args

from hybridmem.errors import SpecError
from hybridmem.job.loss import check_loss_spec
from hybridmem.job.images import normalize_image_size
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.precision import POLICIES, PrecisionPolicy  # noqa: F401 (read as spec.POLICIES)

Precision = Literal["fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed", "bf16-master"]
# one entry per rule of `hybridmem.job.optimizers.OPTIMIZERS` (tests/test_optimizers.py checks)
Optimizer = Literal["adamw", "adamw-fused", "adamw-8bit", "paged-adamw-8bit", "paged-adamw",
                    "sgd", "sgd-momentum", "adafactor", "hf-adafactor", "lion", "lion-32bit",
                    "lion-8bit", "paged-lion", "paged-lion-8bit", "lora-fa"]
Trainable = Literal["full", "llm+projector", "projector", "lora", "peft"]
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

# Precision/optimizer pairs that no framework offers. bitsandbytes' 8-bit optimizers keep their
# own quantised state and are not wrapped by DeepSpeed's fp32-master-weight optimizer
# (transformers refuses `optim=adamw_bnb_8bit` together with a DeepSpeed optimizer).
INVALID_PAIRS: dict[tuple[str, str], str] = {
    **{("bf16-master", o): "8-bit optimizer state cannot sit under fp32 master weights"
       for o in ("adamw-8bit", "paged-adamw-8bit", "lion-8bit", "paged-lion-8bit")},
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
# (hybridmem.job.sac: matmul / SDPA outputs saved, except every second mm, the rest recomputed).
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

    r: int = 8
    """Adapter rank."""
    alpha: float = 16.0
    """Scaling numerator (scale = alpha / r); changes no memory, kept for the record."""
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """Module-name suffixes that get adapters (PEFT `target_modules`)."""
    dropout: float = 0.0
    """LoRA dropout; > 0 saves a dropout mask and the dropped input per adapted layer."""
    use_dora: bool = False
    """DoRA (PEFT `use_dora`): a trainable magnitude vector per adapted layer and the weight
    norm computed in every forward."""
    use_rslora: bool = False
    """rsLoRA scaling alpha / sqrt(r); changes no memory, kept for the record."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full next to the adapters (PEFT `modules_to_save`: a trainable copy)."""

    def __post_init__(self) -> None:
        _check_positive("lora.r", self.r)
        if not self.alpha > 0:
            raise SpecError("lora.alpha", self.alpha, reason="must be > 0")
        if not self.targets:
            raise SpecError("lora.targets", self.targets, DEFAULT_LORA_TARGETS,
                            reason="at least one target module is needed")
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError("lora.dropout", self.dropout, reason="must be in [0, 1)")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    """One training configuration whose per-GPU peak memory we predict."""

    model: str
    """Preset name (see `hybridmem.models.PRESETS`) or path to a HF config.json / folder."""
    micro_batch: int = 1
    """Samples per GPU per step."""
    seq_len: int = 2048
    """Tokens per sample incl. image tokens (LLaVA's `model_max_length` counts both)."""
    images_per_sample: int | None = None
    """Images per sample; None means 1 for a multimodal model and 0 for a decoder LLM."""
    image_size: int | str | None = None
    """Input image side in pixels, or "HxW" (Qwen2-VL / Qwen2.5-VL: native dynamic
    resolution); None means the vision tower's native size. A square is stored as an int."""
    precision: Precision = "bf16-mixed"
    """Where params, grads and optimizer state live (pure, autocast-mixed, master-weights)."""
    optimizer: Optimizer = "adamw"
    """Optimizer; `adamw` is torch's foreach AdamW, the CUDA default; `lora-fa` is peft's
    `create_lorafa_optimizer` (LoRA-FA: lora_A frozen, AdamW on lora_B), train='lora' only."""
    grad_ckpt: bool = False
    """Activation (gradient) checkpointing of the decoder / encoder layers (`grad_ckpt_policy`)."""
    grad_ckpt_policy: str = "full"
    """Which layers `grad_ckpt` checkpoints: `full` (every one) or `every:N` (layers 0, N, 2N,
    ... counted over all checkpointable layers in module order; `ckpt_layer`)."""
    train: Trainable = "full"
    """Which parameters are trained."""
    lora: LoraSpec | None = None
    """LoRA settings; required and only meaningful with `train='lora'`."""
    attn: Attention = "sdpa"
    """Attention implementation (`attn_implementation` in transformers)."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """Data parallelism; the default is one GPU."""
    loop: Loop = "trainer"
    """What outlives the forward: `trainer` (the loss only) or `custom` (the whole output)."""
    max_grad_norm: float = 0.0
    """`clip_grad_norm_(max_norm)` before the step (foreach norms); 0 = no clipping."""
    grad_accum: int = 1
    """Micro-steps whose gradients accumulate before one optimizer step."""
    empty_cache_steps: int = 0
    """`torch.cuda.empty_cache()` every N optimizer steps, where the loop calls it
    (`empty_cache_at`); 0 = never (Trainer's `torch_empty_cache_steps=None`)."""
    optimizer_in_backward: bool = False
    """The step fused into backward per parameter (torchtune `optimizer_in_bwd`;
    `hybridmem.job.optim_in_backward`): gradients are never all alive at once."""
    liger: bool = False
    """Liger kernels as transformers' `use_liger_kernel=True` applies them (fused linear
    cross-entropy, RMSNorm, SwiGLU, RoPE; `hybridmem.job.loss`)."""
    chunked_ce: int = 0
    """Chunked cross-entropy (torchtune `CEWithChunkedOutputLoss`): the logits in N chunks,
    each upcast to fp32 inside the loss; 0 = off (HF's `ForCausalLMLoss`)."""
    offload_activations: str = "none"
    """Saved activations kept in host memory (`hybridmem.job.offload`): `all` (TRL
    `activation_offloading`, the whole step) or `ckpt-inputs` (transformers' checkpointing
    `offload=True`: the checkpointed layers' inputs); `none` keeps them on the GPU."""
    packing: bool = False
    """Padding-free packed batches (TRL `padding_free` / `packing`; `hybridmem.job.packing`):
    the micro-batch's sequences in one row with restarting position ids, no padding."""
    peft_config: str | None = None
    """Canonical JSON of a PEFT `adapter_config.json` for a non-LoRA method; needs
    `train='peft'` (LoRA/DoRA configs become `train='lora'` with `lora`)."""
    quantize: str = "none"
    """Frozen base weights quantised with bitsandbytes: `none`, `nf4`, `fp4` (4-bit, QLoRA) or
    `int8` (LLM.int8); rules in `hybridmem.job.quantize`. Needs train lora or peft."""
    quant_double_quant: bool = True
    """4-bit: `bnb_4bit_use_double_quant` (uint8 absmax + nested state; the QLoRA recipe's
    choice; a BitsAndBytesConfig file without the key gets transformers' default False)."""
    quant_compute_dtype: str | None = None
    """4-bit `bnb_4bit_compute_dtype` (float32, bfloat16, float16); None: the precision's."""
    quant_storage: str = "uint8"
    """4-bit `bnb_4bit_quant_storage`: dtype of the packed weight tensor."""
    quant_skip: tuple[str, ...] | None = None
    """`llm_int8_skip_modules`: modules left unquantised; None: transformers' default
    (lm_head). Given, it replaces the default (lm_head is then quantised unless listed)."""
    kbit_prep: bool = True
    """peft `prepare_model_for_kbit_training` applied (fp16/bf16 non-quantised params cast to
    fp32); only read with `quantize`."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise SpecError("model", self.model, reason="give a preset name or a config path")
        _check_positive("micro_batch", self.micro_batch)
        _check_positive("seq_len", self.seq_len)
        if self.images_per_sample is not None and (
            isinstance(self.images_per_sample, bool) or not isinstance(self.images_per_sample, int)
            or self.images_per_sample < 0
        ):
            raise SpecError("images_per_sample", self.images_per_sample,
                            reason="must be a non-negative integer")
        if self.image_size is not None:  # "HxW" / int, stored as an int for a square
            object.__setattr__(self, "image_size", normalize_image_size(self.image_size))
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("train", self.train, TRAINABLES)
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
        if not isinstance(self.optimizer_in_backward, bool):
            raise SpecError("optimizer_in_backward", self.optimizer_in_backward, [True, False])
        from hybridmem.job import optim_in_backward  # its clashes, stated once there
        optim_in_backward.check(self)
        from hybridmem.job import offload_rules  # likewise (torch-free)
        offload_rules.check(self)
        from hybridmem.job import packing
        packing.check(self)
        if self.train == "peft" and not self.peft_config:
            raise SpecError("peft_config", self.peft_config,
                            reason="train='peft' needs a PEFT adapter config (--peft-config FILE)")
        if self.train != "peft" and self.peft_config is not None:
            raise SpecError("peft_config", "set",
                            reason=f"a non-LoRA PEFT config needs train='peft', not {self.train!r}")
        if isinstance(self.quant_skip, list):
            object.__setattr__(self, "quant_skip", tuple(self.quant_skip))
        from hybridmem.job.quantize import check as check_quantize

        check_quantize(self)

        check_loss_spec(self)

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


# Spec and LoRA fields added after the first dataset rows, with their defaults (see `to_dict`).
ADDED_DEFAULTS: dict[str, object] = {
    "loop": "trainer", "max_grad_norm": 0.0, "grad_accum": 1, "peft_config": None,
    "empty_cache_steps": 0, "grad_ckpt_policy": "full",
    "optimizer_in_backward": False,
    "quantize": "none", "quant_double_quant": True, "quant_compute_dtype": None,
    "quant_storage": "uint8", "quant_skip": None, "kbit_prep": True,
    "liger": False, "chunked_ce": 0, "offload_activations": "none", "packing": False,
    "use_dora": False, "use_rslora": False, "modules_to_save": (),
}


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
