"""Quantised base weights (bitsandbytes, as transformers loads them): the one home of the rules.

Every tier reads this module: which nn.Linear modules are quantised, the tensors bitsandbytes
keeps per quantised weight, the dequantised-weight temporaries of its forward and backward, and
what peft's `prepare_model_for_kbit_training` changes. Sources (read at bitsandbytes 0.48.2,
transformers 5.24, peft 0.21; docs/quantize.md has the derivations and measured numbers):

- which modules: transformers `integrations/bitsandbytes.py replace_with_bnb_linear` converts
  every module whose `type(module) is nn.Linear` (and GPT-2 `Conv1D`) unless
  `quantizers_utils.should_convert_module` matches it against `modules_to_not_convert`, which
  `HfQuantizer.get_modules_to_not_convert` (quantizers/base.py) builds: `llm_int8_skip_modules`
  when given (the defaults are then NOT added), else `get_keys_to_not_convert` = tied weights,
  the last parameter's module and the output embeddings: `lm_head`; plus the model's
  `_keep_in_fp32_modules` (none in Llama / LLaVA / CLIP). In transformers 5.x the vision tower
  and the projector of a LLaVA are therefore quantised too (their Linears are nn.Linear).
- 4-bit weight (bnb `functional.quantize_4bit`, fake kernel `_ops.py` "quantize_4bit"): packed
  data `((n + 1) // (quant_storage.itemsize * 2), 1)` of `quant_storage` (uint8 default), absmax
  fp32 per `blocksize` = 64 elements (`Params4bit.__new__` default on CUDA), the code table
  (`get_4bit_type`: a new 16-entry fp32 tensor per weight). Double quantisation
  (`compress_statistics`, `bnb_4bit_use_double_quant`): absmax becomes uint8 (`quantize_blockwise
  (_absmax - offset, blocksize=256)`), plus the 0-dim fp32 `offset` (`_absmax.mean()`), the nested
  absmax fp32 per 256 and a per-weight copy of the 256-entry fp32 dynamic map
  (`code.to(A.device, copy=True)`).
- 8-bit weight (`Int8Params._quantize`, `int8_vectorwise_quant`): CB int8 (out, in) is the
  parameter's data, SCB fp32 (out,).
- forward/backward of a 4-bit Linear (`nn.Linear4bit.forward`, `autograd/_functions.py
  MatMul4Bit`): `x.to(compute_dtype)`; `dequantize_4bit` (with double quant first
  `dequantize_blockwise` of absmax: an fp32 tensor per 64 elements) gives the full weight in
  `quant_state.dtype` (the dtype the weight had when quantised), `.to(A.dtype)` a second copy if
  that differs; `F.linear` runs under no_grad (inside an autograd.Function), ctx keeps only the
  packed weight, so nothing of the input is saved; the output is cast back `.to(inp_dtype)`. The
  backward dequantises again for `grad_A = grad_output @ W`.
- 8-bit (`MatMul8bitLt`, CUDA path): `A.to(float16)` quantised row-wise (`int8_vectorwise_quant`:
  CA int8 + fp32 row stats), `int8_scaled_mm` output; ctx keeps A (the input) when any input
  needs a grad; the backward builds `CB.to(A.dtype).mul_(SCB / 127)` (a full weight) for grad_A.
  The outlier path of `llm_int8_threshold` > 0 depends on the data; priced with no outliers.
- `peft.prepare_model_for_kbit_training` (peft/utils/other.py): freezes every parameter, casts
  every fp16/bf16 parameter that is not `Params4bit` to fp32 (Int8Params are int8, untouched),
  and with `use_gradient_checkpointing` (its default True) enables input grads and
  `gradient_checkpointing_enable`. TRL's SFTTrainer and the QLoRA scripts call it. The spec
  records it as `kbit_prep` (default True, as those recipes); its checkpointing is the spec's
  own `grad_ckpt` (QLoRA recipes set it; peft's default would).
- the dtype the base model is loaded in is the precision's parameter dtype (`PARAM_DTYPE`: fp32
  under *-mixed, bf16 under bf16): the quantised weights' `quant_state.dtype` is that dtype.

A technique behind `techniques.protocol` (off any axis); its emulated layers for the trace tier
are `trace/quantized.py` and the harness's real conversion `harness/workload.py quantize_bnb`,
both gated on `quant_of(spec)`, as are the analytic tier's weight terms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridmem.errors import SpecError
from hybridmem.objectives import OBJECTIVES as ALL_OBJECTIVES
from hybridmem.job.precision import POLICIES
from hybridmem.jsonfile import read_json_object
from hybridmem.techniques.protocol import Target

QUANTIZE: tuple[str, ...] = ("none", "nf4", "fp4", "int8")
FOUR_BIT: tuple[str, ...] = ("nf4", "fp4")
# bits per quantised base weight (0: not quantised): bitsandbytes NF4 / FP4 (Params4bit) 4,
# LLM.int8 (Int8Params) 8
BITS: dict[str, int] = {"none": 0, **dict.fromkeys(FOUR_BIT, 4), "int8": 8}
# quant_storage / compute dtypes a BitsAndBytesConfig may name, with their itemsize
DTYPE_BYTES: dict[str, int] = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
STORAGE_DTYPES: tuple[str, ...] = ("uint8", "int8", "bfloat16", "float16", "float32")
# train modes a quantised base allows: transformers' Trainer refuses to fine-tune a purely
# quantised model ("You cannot perform fine-tuning on purely quantized models", trainer.py
# `_is_peft_model`/`is_quantized` check); Params4bit/Int8Params are created requires_grad=False
QUANT_TRAINS: tuple[str, ...] = ("lora", "peft")

BLOCKSIZE = 64          # Params4bit / quantize_4bit default blocksize (CUDA; 128 on ROCm)
NESTED_BLOCKSIZE = 256  # quantize_4bit(compress_statistics=True): quantize_blockwise(..., 256)
CODE_4BIT = 16          # get_4bit_type: 16 fp32 entries
DYNAMIC_MAP = 256       # create_dynamic_map(): 256 fp32 entries, copied per nested state
DEFAULT_SKIP: tuple[str, ...] = ("lm_head",)  # get_keys_to_not_convert on Llama / LLaVA
FP32, FP16, INT8 = 4, 2, 1


@dataclass(frozen=True, slots=True)
class Alloc:
    """One tensor bitsandbytes allocates: its name, element count and itemsize."""

    name: str
    numel: int
    itemsize: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Quant:
    """The quantisation of one spec, with everything the tiers need to price it."""

    method: str
    """nf4, fp4 or int8."""
    double_quant: bool
    compute_bytes: int
    """Itemsize of `bnb_4bit_compute_dtype` (the dtype the 4-bit matmul runs in)."""
    compute_dtype: str
    storage_bytes: int
    """Itemsize of `bnb_4bit_quant_storage`."""
    weight_bytes: int
    """Itemsize of the weight when quantised (`quant_state.dtype`: the load dtype)."""
    skip: tuple[str, ...]
    kbit_prep: bool

    @property
    def four_bit(self) -> bool:
        return self.method in FOUR_BIT

    def converts(self, name: str) -> bool:
        """Whether the nn.Linear at full HF module name `name` is quantised
        (transformers quantizers_utils.py `should_convert_module`, same matching)."""
        return converts(name, self.skip)

    def weight_allocs(self, n_out: int, n_in: int) -> list[Alloc]:
        """The tensors kept per quantised (out x in) weight (module docstring)."""
        n = n_out * n_in
        if not self.four_bit:
            return [Alloc("CB", n, INT8), Alloc("SCB", n_out, FP32)]
        packed = (n + 1) // (self.storage_bytes * 2)
        blocks = -(-n // BLOCKSIZE)
        out = [Alloc("weight", packed, self.storage_bytes)]
        if not self.double_quant:
            return out + [Alloc("absmax", blocks, FP32), Alloc("code", CODE_4BIT, FP32)]
        nested = -(-blocks // NESTED_BLOCKSIZE)
        return out + [Alloc("absmax", blocks, INT8), Alloc("offset", 1, FP32),
                      Alloc("state2.absmax", nested, FP32),
                      Alloc("state2.code", DYNAMIC_MAP, FP32), Alloc("code", CODE_4BIT, FP32)]

    def dequant(self, n_out: int, n_in: int, a_bytes: int) -> list[Alloc]:
        """The tensors one 4-bit dequantisation makes, in order, for a matmul in `a_bytes`
        (MatMul4Bit: absmax fp32 when nested, W in quant_state.dtype, W.to(A.dtype) when it
        differs; the absmax is freed once W exists, W once its cast exists)."""
        n = n_out * n_in
        if not self.four_bit:
            # MatMul8bitLt backward: CB.to(A.dtype, copy=True) (then mul_ in place)
            return [Alloc("CB.to", n, a_bytes)]
        out = [Alloc("absmax", -(-n // BLOCKSIZE), FP32)] if self.double_quant else []
        out.append(Alloc("weight", n, self.weight_bytes))
        if a_bytes != self.weight_bytes:
            out.append(Alloc("weight.to", n, a_bytes))
        return out


def converts(name: str, skip: tuple[str, ...]) -> bool:
    """transformers `should_convert_module(full_name, patterns)`: a pattern skips the module when
    it matches from the start up to a module boundary, as a regex with the same boundary, or as
    a suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in skip)


NAME = "quantize"
AXIS = None  # the base weights' storage: combines with the other techniques
FLAG = "quantize"
# priced with every objective (it changes the base weights, not the loss)
OBJECTIVES: tuple[str, ...] = ALL_OBJECTIVES


def active(spec) -> bool:
    return spec.quantize != "none"


def applies(target: Target) -> bool:
    return True  # every nn.Linear the rules convert (`Quant.converts`), in any model


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return None


def note(spec, model_type: str | None = None, applies: bool = True) -> str | None:
    return None  # the tiers' own (the quantised weights' bytes in the breakdown)


def install(model, spec, target: Target) -> str | None:
    return None  # the trace tier builds its emulated layers itself (`trace/model.py quantize`)


def apply_real(model, spec) -> None:
    return None  # the harness converts with bitsandbytes itself (`quantize_bnb`), before PEFT


def quant_of(spec) -> Quant | None:
    """The spec's quantisation, or None when the base weights are not quantised."""
    if spec.quantize == "none":
        return None
    compute = spec.quant_compute_dtype or default_compute(spec.precision)
    return Quant(method=spec.quantize, double_quant=spec.quant_double_quant,
                 compute_bytes=DTYPE_BYTES[compute], compute_dtype=compute,
                 storage_bytes=DTYPE_BYTES[spec.quant_storage],
                 weight_bytes=POLICIES[spec.precision].param_bytes,
                 skip=DEFAULT_SKIP if spec.quant_skip is None else tuple(spec.quant_skip),
                 kbit_prep=spec.kbit_prep)


KBIT_CHECKPOINTING = (
    "peft default: prepare_model_for_kbit_training(model) has use_gradient_checkpointing=True "
    "(peft/utils/other.py); --no-grad-ckpt if your script passes False")
"""Why `grad_ckpt` is on by default for a quantised job given on the command line alone (the
`job` echo's source of the field)."""
LAUNCHER_INPUTS: tuple[str, ...] = ("config", "training_args", "recipe")
"""Inputs that name the launcher, which then decides checkpointing itself: axolotl passes
`use_gradient_checkpointing=cfg.gradient_checkpointing` (axolotl loaders/model.py
`prepare_model`), TRL's trainers `args.gradient_checkpointing` (trl experimental/utils.py
`prepare_peft_model`; TRL 1.x's SFTTrainer no longer calls it), and LLaMA-Factory never calls
it (its own `prepare_model_for_training` checkpoints unless `disable_gradient_checkpointing`)."""


def kbit_checkpointing(spec, given: dict) -> bool:
    """Whether a quantised job's checkpointing follows peft's default: `kbit_prep` (the user's
    script calls `prepare_model_for_kbit_training`, the default without a launcher), with
    neither `--grad-ckpt` / `--no-grad-ckpt` nor a launcher input (`LAUNCHER_INPUTS`) among the
    option values `given` (None = not given)."""
    return (spec.quantize != "none" and spec.kbit_prep and not spec.grad_ckpt
            and given.get("grad_ckpt") is None
            and all(given.get(k) is None for k in LAUNCHER_INPUTS))


def default_compute(precision: str) -> str:
    """`bnb_4bit_compute_dtype` when none is given: the precision's compute dtype (the QLoRA
    recipes set bf16 with bf16 training; BitsAndBytesConfig's own default is float32, which a
    --quantization-config file without the key gets)."""
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("fp16"):
        return "float16"
    return "float32"


def check(spec) -> None:
    """The spec's quantisation fields against each other and the rest (one-line SpecErrors)."""
    if spec.quantize not in QUANTIZE:
        raise SpecError("quantize", spec.quantize, QUANTIZE)
    if spec.quant_compute_dtype is not None and spec.quant_compute_dtype not in COMPUTE_DTYPES:
        raise SpecError("quant_compute_dtype", spec.quant_compute_dtype, COMPUTE_DTYPES)
    if spec.quant_storage not in STORAGE_DTYPES:
        raise SpecError("quant_storage", spec.quant_storage, STORAGE_DTYPES)
    for name in ("quant_double_quant", "kbit_prep"):
        if not isinstance(getattr(spec, name), bool):
            raise SpecError(name, getattr(spec, name), [True, False])
    if spec.quant_skip is not None and (isinstance(spec.quant_skip, str) or not all(
            isinstance(s, str) and s for s in spec.quant_skip)):
        raise SpecError("quant_skip", spec.quant_skip, reason="give a list of module names")
    if spec.quantize == "none":
        return
    if spec.train not in QUANT_TRAINS:
        raise SpecError("quantize", spec.quantize, ["none"],
                        reason=f"quantised base weights cannot train with train={spec.train!r} "
                        "(bitsandbytes weights are frozen; use train lora or peft)")
    if spec.parallel.strategy in ("zero3", "fsdp"):
        raise SpecError("quantize", spec.quantize, ["none"],
                        reason=f"sharding quantised weights (strategy={spec.parallel.strategy!r}) "
                        "is not priced yet")


def from_bnb_config(source, field: str = "quantization_config") -> dict:
    """TrainingSpec fields from a BitsAndBytesConfig (a dict, or a JSON file / folder holding
    config.json with a `quantization_config`), parsed by transformers' own
    `BitsAndBytesConfig.from_dict` (its defaults: fp4, no double quant, float32 compute, uint8
    storage; its type checks). Anything but bitsandbytes, or a file it refuses, is one line."""
    import json
    import os

    if not isinstance(source, dict):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        source = read_json_object(path, field)
        if "quantization_config" in source and "load_in_4bit" not in source \
                and "_load_in_4bit" not in source:
            source = source["quantization_config"]  # a model config.json
    data = json.loads(json.dumps(source))
    method = str(data.get("quant_method", "bitsandbytes"))
    if method != "bitsandbytes":
        raise SpecError(f"{field}.quant_method", method, ["bitsandbytes"],
                        reason="only bitsandbytes quantisation is priced")
    for key in ("load_in_4bit", "load_in_8bit"):  # to_dict() writes both spellings
        if f"_{key}" in data:
            data.setdefault(key, data.pop(f"_{key}"))
    if data.get("load_in_4bit") and data.get("load_in_8bit"):
        raise SpecError(f"{field}.load_in_8bit", True,
                        reason="load_in_4bit and load_in_8bit cannot both be true "
                        "(BitsAndBytesConfig refuses it)")
    from transformers import BitsAndBytesConfig

    try:
        cfg = BitsAndBytesConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise SpecError(field, source if isinstance(source, str) else "{...}",
                        reason=" ".join(str(err).split())[:200]) from None
    if not (cfg.load_in_4bit or cfg.load_in_8bit):
        raise SpecError(f"{field}.load_in_4bit", False, reason="neither load_in_4bit nor "
                        "load_in_8bit is set: nothing is quantised")
    if cfg.load_in_8bit:
        out = {"quantize": "int8"}
    else:
        if cfg.bnb_4bit_quant_type not in FOUR_BIT:
            raise SpecError(f"{field}.bnb_4bit_quant_type", cfg.bnb_4bit_quant_type, FOUR_BIT)
        out = {"quantize": cfg.bnb_4bit_quant_type,
               "quant_double_quant": bool(cfg.bnb_4bit_use_double_quant),
               "quant_compute_dtype": str(cfg.bnb_4bit_compute_dtype).removeprefix("torch."),
               "quant_storage": str(cfg.bnb_4bit_quant_storage).removeprefix("torch.")}
    if cfg.llm_int8_skip_modules is not None:
        out["quant_skip"] = tuple(cfg.llm_int8_skip_modules)
    return out


def bnb_kwargs(spec) -> dict:
    """BitsAndBytesConfig keyword arguments that build the spec's quantisation for real (the
    CUDA harness): the same knobs the tiers price."""
    quant = quant_of(spec)
    if quant is None:
        return {}
    skip = {} if spec.quant_skip is None else {"llm_int8_skip_modules": list(spec.quant_skip)}
    if not quant.four_bit:
        return {"load_in_8bit": True, **skip}
    return {"load_in_4bit": True, "bnb_4bit_quant_type": quant.method,
            "bnb_4bit_use_double_quant": quant.double_quant,
            "bnb_4bit_compute_dtype": quant.compute_dtype,
            "bnb_4bit_quant_storage": spec.quant_storage, **skip}
