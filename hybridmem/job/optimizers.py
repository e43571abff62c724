"""Every optimizer a spec can name, owned once: state layout, step temporaries, constructor, names.

Each `Rule` answers, for one optimizer, what every tier needs:

- `state(s)`: the allocations (elements, itemsize) of the state of one stepped tensor `s` that go
  through PyTorch's caching allocator; valid for a model tensor and for one flat 1-D ZeRO
  partition alike (a 1-D tensor: e.g. Adafactor is unfactored on it);
- `paged_state(s)`: state in CUDA unified memory (bitsandbytes `paged_*`), outside the
  allocator: not in `memory_allocated`/`reserved`, resident on the device until the driver pages
  it out under pressure (docs/design.md, "Optimizers");
- `shared(stepped)`: state shared by all tensors (bitsandbytes' quantisation maps);
- `temporary(stepped, size)`: the peak of the step's short-lived tensors over the stepped tensors
  (foreach vs per-tensor rules), each priced by `size(elements, itemsize)`;
  `temporary_stream(stepped, size)`: the same tensors as an alloc/free order for the allocator
  replay (a rule that keeps only its peak gives it as one block, priced by `size`);
- `build(params, cuda)`: the torch optimizer: the real library on CUDA (bitsandbytes imported
  lazily), the layout emulations below on CPU / meta tensors (trace tier, harness stand-in);
- `hf`: the TrainingArguments `optim` names (transformers 5.x `OptimizerNames`,
  `trainer_optimizer.py`) that build it.

The analytic tier (`analytic/states.py`, `events.py`), the per-rank layer
(`parallel/sharding.py`), the trace tier (`trace/optimizers.py`) and the harness
(`harness/workload.py`) read these rules; none keeps its own copy.

The rules' shape is `optimizer_rule.py`, the rules by library `optimizer_kinds.py`, their CPU /
meta layouts `optimizer_layouts.py`; this module is the registry every importer reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridmem.errors import SpecError
from hybridmem.job.optimizer_kinds import (  # noqa: F401  (the rules, named here as before)
    LORAFA_WEIGHT_DECAY, SGD, AdamW, Bnb, HFAdafactor, LionPytorch, LoraFA, TorchAdafactor,
    lorafa_temporary,
)
from hybridmem.job.optimizer_layouts import BnbLayout, lion_pytorch  # noqa: F401
from hybridmem.job.optimizer_rule import (  # noqa: F401  (the rule's shape, named here as before)
    BF16, BNB_BLOCK, BNB_MIN_8BIT, BNB_PAGED_MIN, BNB_QMAP, FP32, LR, Alloc, LoopLocals, Rule,
    Size, Stepped, flat, raw,
)

_RULES: tuple[Rule, ...] = (
    AdamW("adamw", "torch foreach AdamW (the CUDA default)", hf=("adamw_torch",),
          host_keys=("step",)),
    AdamW("adamw-fused", "torch fused AdamW", hf=("adamw_torch_fused",), fused=True),
    Bnb("adamw-8bit", "bitsandbytes AdamW8bit", hf=("adamw_bnb_8bit", "adamw_8bit"), bits=8),
    Bnb("paged-adamw-8bit", "bitsandbytes PagedAdamW8bit (states in unified memory)",
        hf=("paged_adamw_8bit",), bits=8, paged=True),
    Bnb("paged-adamw", "bitsandbytes PagedAdamW32bit (fp32 states in unified memory)",
        hf=("paged_adamw_32bit",), bits=32, paged=True),
    SGD("sgd", "torch SGD, no momentum", hf=("sgd",)),
    SGD("sgd-momentum", "torch SGD with momentum", momentum=0.9),
    TorchAdafactor("adafactor", "torch.optim.Adafactor (foreach)", host_keys=("step",)),
    HFAdafactor("hf-adafactor", "transformers' Adafactor (TrainingArguments optim=adafactor)",
                hf=("adafactor",)),
    LionPytorch("lion", "Lion as lucidrains/lion-pytorch"),
    Bnb("lion-32bit", "bitsandbytes Lion (fp32 state)", hf=("lion_32bit",), algo="lion",
        bits=32),
    Bnb("lion-8bit", "bitsandbytes Lion8bit", hf=("lion_8bit",), algo="lion", bits=8),
    Bnb("paged-lion", "bitsandbytes PagedLion (fp32 state in unified memory)",
        hf=("paged_lion_32bit",), algo="lion", bits=32, paged=True),
    Bnb("paged-lion-8bit", "bitsandbytes PagedLion8bit", hf=("paged_lion_8bit",), algo="lion",
        bits=8, paged=True),
    LoraFA("lora-fa", "peft LoRA-FA (train=lora only)", trains="lora"),
)
OPTIMIZERS: dict[str, Rule] = {r.name: r for r in _RULES}
"""Our optimizer names (`TrainingSpec.optimizer`, `--optimizer`) -> their rule."""

HF_OPTIMS: dict[str, str] = {hf: r.name for r in _RULES for hf in r.hf}
"""TrainingArguments `optim` -> our optimizer name."""
# transformers 5.x default `optim` (training_args.py: adamw_torch_fused for torch >= 2.8)
HF_DEFAULT_OPTIM = "adamw_torch_fused"
# `OptimizerNames` the trainer builds from packages we cannot price soundly here: GaLore needs
# `galore-torch` (trainer_optimizer.py `_get_galore_optimizer`), whose projector layout we have
# not read against its source; refused in one line (docs/design.md, "Optimizers")
HF_REFUSED: dict[str, str] = {
    name: "GaLore (galore-torch) is not priced" for name in (
        "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
        "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise")}


def rule(name: str) -> Rule:
    """The rule of optimizer `name`; a SpecError naming the valid ones otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise SpecError("optimizer", name, tuple(OPTIMIZERS)) from None


def from_hf(optim: str, optim_args: str | None = None, field_name: str = "training_args.optim"
            ) -> str:
    """Our optimizer name for TrainingArguments `optim` (+ `optim_args`, "k=v,k=v" as
    trainer_optimizer.py `_parse_optim_args` reads it: `sgd` with `momentum` > 0 is our
    `sgd-momentum`, `_get_sgd`)."""
    if optim in HF_REFUSED:
        raise SpecError(field_name, optim, sorted(HF_OPTIMS), reason=HF_REFUSED[optim])
    if optim not in HF_OPTIMS:
        raise SpecError(field_name, optim, sorted(HF_OPTIMS))
    name = HF_OPTIMS[optim]
    if name == "sgd" and optim_args:
        args = dict(kv.split("=", 1) for kv in optim_args.replace(" ", "").split(",") if "=" in kv)
        try:
            momentum = float(args.get("momentum", 0))
        except ValueError:
            raise SpecError("training_args.optim_args", optim_args,
                            reason="momentum must be a number") from None
        if momentum:  # the value changes no memory
            return "sgd-momentum"
    return name


def stepped_sizes(name: str, stepped: Sequence[Stepped], size: Size = raw) -> dict[str, int]:
    """Bytes of one optimizer over `stepped`: device state, paged state, shared, temporary."""
    r = rule(name)
    return {"state": sum(size(*a) for s in stepped for a in r.state(s)),
            "paged": sum(raw(*a) for s in stepped for a in r.paged_state(s)),
            "shared": sum(size(*a) for a in r.shared(stepped)),
            "temporary": r.temporary(stepped, size)}


def paged_notes(paged: int) -> tuple[str, ...]:
    """The note every tier gives a job with paged optimizer state."""
    if not paged:
        return ()
    return (f"paged optimizer state: {paged / 2**30:.2f} GiB in CUDA unified memory "
            "(bitsandbytes paged_*, cudaMallocManaged), outside PyTorch's allocator: not in "
            "allocated/reserved, in context and the device peak while resident; the driver "
            "pages it to host memory under pressure instead of OOM, so the fit verdict does not "
            "count it",)


__all__ = ["OPTIMIZERS", "HF_OPTIMS", "HF_DEFAULT_OPTIM", "Rule", "Stepped", "flat", "from_hf",
           "rule", "raw", "stepped_sizes", "lorafa_temporary", "paged_notes"]
