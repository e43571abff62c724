"""Bytes per element of parameters, grads, optimizer state and activations under each precision,
and the precision as the axes users set (weights dtype, autocast, master weights, adapter dtype).

A precision shorthand (`fp32`, `bf16`, `bf16-mixed`, ...) names one combination of the axes
(`AXES`, one table); axes given one by one override the shorthand's and fold back into the
shorthand they name (`fold`), so every tier keeps pricing the shorthand's `PrecisionPolicy`.
The adapter dtype is its own axis (`check_adapters`, `adapter_bytes`).

Its own module so that the technique modules (`techniques/quantize.py`: the weight dtype of quantised
layers) read it without importing the spec that checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.errors import SpecError

# dtype of parameters / grads / optimizer state per precision policy, in bytes.
# Source: torch.amp docs (autocast keeps fp32 params), DeepSpeed bf16_optimizer.py (bf16 params
# + fp32 master copy + fp32 Adam state), Megatron `--bf16` with distributed optimizer.
@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    param_bytes: int
    """Bytes per element of the model's parameters."""
    grad_bytes: int
    """Bytes per element of the .grad tensors."""
    state_bytes: int
    """Bytes per element of each full-precision optimizer state tensor."""
    master_bytes: int
    """Bytes per element of a separate master copy of trainable params (0 = none)."""
    compute_bytes: int
    """Bytes per element of activations (autocast dtype or param dtype)."""


DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""Choices of `weights_dtype` and `adapter_dtype`."""
AUTOCASTS: tuple[str, ...] = ("none", "bf16", "fp16")
"""Choices of `autocast` (torch.autocast's dtype; none: ops run in the weights' dtype)."""


@dataclass(frozen=True, slots=True)
class Axes:
    """What a precision shorthand sets, as users set it: the dtype the model is loaded in
    (`torch_dtype`), torch.autocast's dtype, a separate fp32 master copy of the trained
    weights (DeepSpeed's bf16 optimizer)."""

    weights_dtype: str
    autocast: str
    master_weights: bool


# One table: shorthand -> axes. Sources: torch.amp docs (autocast over fp32 params: `*-mixed`,
# HF Trainer `bf16=True` / `fp16=True`), a model loaded with `torch_dtype=bfloat16` and no
# autocast (`bf16`), DeepSpeed bf16_optimizer.py (bf16 params + fp32 master and state), HF
# Trainer `bf16=True` over a model loaded with `torch_dtype=bfloat16` (`bf16-autocast`: bf16
# params and state, autocast's fp32 ops still upcast; LLaMA-Factory's and axolotl's `bf16: true`).
AXES: dict[str, Axes] = {
    "fp32": Axes("fp32", "none", False),
    "bf16": Axes("bf16", "none", False),
    "fp16": Axes("fp16", "none", False),
    "bf16-mixed": Axes("fp32", "bf16", False),
    "fp16-mixed": Axes("fp32", "fp16", False),
    "bf16-master": Axes("bf16", "none", True),
    "bf16-autocast": Axes("bf16", "bf16", False),
}
SHORTHAND: dict[Axes, str] = {axes: name for name, axes in AXES.items()}

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


def _policy(axes: Axes) -> PrecisionPolicy:
    """Bytes per element under `axes`: params and grads in the weights' dtype, optimizer state
    too unless a master copy is kept (then the copy and the state are fp32, DeepSpeed's bf16
    optimizer), activations in the autocast dtype where autocast is on."""
    param = DTYPE_BYTES[axes.weights_dtype]
    master = 4 if axes.master_weights else 0
    compute = DTYPE_BYTES[axes.autocast] if axes.autocast != "none" else param
    return PrecisionPolicy(param, param, master or param, master, compute)


POLICIES: dict[str, PrecisionPolicy] = {name: _policy(axes) for name, axes in AXES.items()}


def casts_weights(precision: str) -> bool:
    """Autocast over fp32 weights (`*-mixed`): every matmul casts its weight to the autocast
    dtype and the residual stream stays fp32. Over half weights (`bf16-autocast`) autocast
    casts only what is fp32 (peft's adapters, the fp32-list ops' outputs)."""
    axes = AXES[precision]
    return axes.autocast != "none" and axes.weights_dtype == "fp32"


def deepspeed_precision(strategy: str, precision: str) -> str:
    """The precision a job really runs under `strategy`: DeepSpeed ZeRO's bf16/fp16 is a 16-bit
    model + an fp32 master partition (the engine casts the module), priced as bf16-master (fp16
    has the same bytes); anything else is unchanged."""
    if strategy.startswith("zero") and precision in ("bf16-mixed", "fp16-mixed", "bf16-autocast"):
        return "bf16-master"
    return precision


def _priced() -> str:
    """The priced combinations, weights/autocast[+master]=shorthand."""
    return ", ".join(f"{a.weights_dtype}/{a.autocast}" + ("+master" if a.master_weights else "")
                     + f"={name}" for name, a in AXES.items())


def fold(precision: str | None, weights_dtype: str | None, autocast: str | None,
         master_weights: bool | None) -> str | None:
    """The shorthand that the axes given individually make over `precision`'s own axes (each
    given axis overrides the shorthand's). Without a shorthand the missing axes complete the
    given ones: autocast alone means fp32 weights (torch.amp's use), weights alone mean no
    autocast and no master copy. A combination no shorthand names is a SpecError naming the
    axis and the combinations priced; no axis given returns `precision` unchanged."""
    for name, value, choices in (("weights_dtype", weights_dtype, DTYPES),
                                 ("autocast", autocast, AUTOCASTS)):
        if value is not None and value not in choices:
            raise SpecError(name, value, choices)
    if master_weights is not None and not isinstance(master_weights, bool):
        raise SpecError("master_weights", master_weights, (True, False))
    if weights_dtype is None and autocast is None and master_weights is None:
        return precision
    base = AXES[precision] if precision is not None else Axes(
        "fp32" if autocast not in (None, "none") and weights_dtype is None
        else weights_dtype or "fp32", "none", False)
    axes = Axes(weights_dtype or base.weights_dtype, autocast or base.autocast,
                base.master_weights if master_weights is None else master_weights)
    if axes in SHORTHAND:
        return SHORTHAND[axes]
    field, value = (("master_weights", axes.master_weights)
                    if master_weights is not None and Axes(axes.weights_dtype, axes.autocast,
                                                           False) in SHORTHAND
                    else ("autocast", axes.autocast) if autocast is not None
                    else ("weights_dtype", axes.weights_dtype))
    master = " and an fp32 master copy" if axes.master_weights else ""
    raise SpecError(field, value, reason=f"weights {axes.weights_dtype} with autocast "
                    f"{axes.autocast}{master} is not priced; priced (weights/autocast): "
                    f"{_priced()}")


def adapter_bytes(adapter_dtype: str | None) -> int | None:
    """Bytes per element of LoRA adapters: 4 for fp32 (peft's `autocast_adapter_dtype=True`,
    the default), None for adapters in the weights' dtype (they follow the precision policy
    like the base's params: torchtune's LoRALinear, peft with `autocast_adapter_dtype=False`)."""
    return 4 if adapter_dtype in (None, "fp32") else None


def check_adapters(adapter_dtype: str | None, precision: str | None, train: str,
                   dora: bool, quantize: str) -> None:
    """Half-precision adapters are the weights' own dtype in a pure run (peft moves new
    adapters to the base layer's dtype, `_move_adapter_to_device_of_base_layer`, and only
    `autocast_adapter_dtype=True` casts them back to fp32); any other pairing is a SpecError."""
    if adapter_dtype is None or adapter_dtype == "fp32":
        return
    if adapter_dtype not in DTYPES:
        raise SpecError("adapter_dtype", adapter_dtype, DTYPES)
    if train != "lora":
        raise SpecError("adapter_dtype", adapter_dtype, ("fp32",),
                        reason=f"only LoRA adapters are priced in half precision, not train={train!r}")
    if dora or quantize != "none":
        raise SpecError("adapter_dtype", adapter_dtype, ("fp32",),
                        reason="half-precision adapters are priced for plain LoRA only "
                        "(not DoRA, not over a quantised base)")
    if precision is not None and AXES[precision] != Axes(adapter_dtype, "none", False):
        raise SpecError("adapter_dtype", adapter_dtype, ("fp32",),
                        reason=f"adapters in {adapter_dtype} need weights in {adapter_dtype} "
                        f"without autocast or master copy (precision={adapter_dtype}), "
                        f"not precision={precision!r}")


def in_words(precision: str, train: str, strategy: str = "none",
             mp_param_dtype: str = "auto", mp_reduce_dtype: str = "auto",
             adapter_dtype: str | None = None) -> str:
    """The precision as the axes users set: weights dtype, compute (autocast) dtype, adapter
    dtype, master weights, and FSDP2's gather / reduce dtypes; for the console's job echo."""
    axes = AXES[precision]
    weights = axes.weights_dtype
    compute = weights if axes.autocast == "none" else axes.autocast
    autocast = axes.autocast != "none"  # torch.amp: fp32 params, 16-bit compute
    parts = [f"weights {weights}", f"compute {compute}" + (" (autocast)" if autocast else "")]
    if train in ("lora", "peft"):
        parts.append("adapters fp32 (peft)" if adapter_dtype in (None, "fp32")
                     else f"adapters {adapter_dtype}")  # peft autocast_adapter_dtype=True
    parts.append("fp32 master weights" if axes.master_weights else "no master copy")
    if strategy == "fsdp":
        gather = compute if mp_param_dtype == "auto" else mp_param_dtype
        reduce = gather if mp_reduce_dtype == "auto" else mp_reduce_dtype
        parts.append(f"FSDP2 gather {gather}, reduce {reduce}")
    return ", ".join(parts)
