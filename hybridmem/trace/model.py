"""Build the real `transformers` model for a spec under FakeTensorMode (no weights, no memory).

Traps handled here (docs/design.md, "Facts measured or read"): fake `cuda` tensors do not work on a
CPU-only build, so tensors are CPU fakes; `model.to(dtype)` fails on fake parameters, so the
parameter dtype comes from `torch.set_default_dtype`; `peft.get_peft_model` moves adapters with
`.to()`, which fails the same way, so that move is skipped (the adapters are already created on
the base layer's device), for every PEFT method.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from hybridmem.adapters import (
    build_error, build_peft_config, lora_llm_pattern,
)
from hybridmem import objectives
from hybridmem.errors import SpecError, UnsupportedModelError
from hybridmem.job.lora_targets import default_targets
from hybridmem.models.build import DECODER_TRAINS, TRAINABLE_MODULES, part_of
from hybridmem.models.loader import auto_class
from hybridmem.job.spec import TrainingSpec
from hybridmem.torch_dtype import AXIS_DTYPE, PARAM_DTYPE, default_dtype

def attn_for_cpu(attn: str) -> str:
    """FlashAttention-2 has no CPU kernel; its memory behaviour is SDPA's flash backend's."""
    return "sdpa" if attn == "flash_attention_2" else attn


def unsupported(spec: TrainingSpec, what: str, err: BaseException) -> UnsupportedModelError:
    """The one line for a model the trace tier cannot run: the model's own error, whitespace
    folded and cut to 300 characters (transformers' messages span lines and URLs); `predict`
    adds the tier that prices the job, if any (`tiers.no_tier`)."""
    text = " ".join(str(err).split())[:300]
    return UnsupportedModelError("model", spec.model,
                                 reason=f"{what} ({type(err).__name__}: {text})")


def build_model(spec: TrainingSpec, config) -> nn.Module:
    """The HF model for `config`, its parameters fake, in the spec's parameter dtype."""
    import transformers
    from hybridmem.trace.compat import no_init_weights
    from hybridmem.trace.config_checks import check_token_ids

    check_token_ids(config)  # a config no backend can build: one line naming the field
    auto = getattr(transformers, auto_class(config.model_type))
    dtype = PARAM_DTYPE[spec.precision]
    # from_config writes `dtype` into the config (and would use the preset's `torch_dtype`
    # without it): work on a copy, with the spec's dtype given explicitly.
    config = copy.deepcopy(config)
    if objectives.of(spec).SCORE_HEAD:  # TRL RewardTrainer: a classifier with one label
        auto = transformers.AutoModelForSequenceClassification
        config.num_labels = 1
        if getattr(config, "pad_token_id", None) is None:  # the last token's score is read
            config.pad_token_id = 0
    if hasattr(config, "quantization_config"):  # a pre-quantised checkpoint's: `quantize()`
        del config.quantization_config
    with default_dtype(dtype), no_init_weights():
        try:
            model = auto.from_config(config, dtype=dtype,
                                     attn_implementation=attn_for_cpu(spec.attn))
        except Exception as err:  # the model's own code refused to build under fake tensors
            if "does not support an attention implementation" in str(err):
                # transformers' `_check_and_adjust_attn_implementation` (Gemma 2 and others
                # have no SDPA path): the user's choice, eager is always there
                raise SpecError("attn", spec.attn, ("eager",),
                                reason=f"{type(err).__name__}: transformers' {config.model_type} "
                                "code does not support it") from err
            raise unsupported(spec, "its code cannot be built under fake tensors",
                              err) from err
    # `no_init_weights` also skips tying: tie as `from_pretrained`/`post_init` would (Llama-3.2
    # ties lm_head to embed_tokens; untied it would count 394M parameters twice)
    model.tie_weights()
    model.train()
    return model


def quantize(model: nn.Module, spec: TrainingSpec) -> None:
    """Quantised base weights (`--quantize`): bitsandbytes' Linears emulated
    (`trace.quantized`), then peft's `prepare_model_for_kbit_training` casts when the spec
    says so. Call after `freeze` (the casts keep requires_grad=False)."""
    from hybridmem.techniques.quantize import quant_of
    from hybridmem.trace import quantized

    quant = quant_of(spec)
    if quant is None:
        return
    quantized.replace_linears(model, quant, PARAM_DTYPE[spec.precision])
    if quant.kbit_prep:
        quantized.prepare_kbit(model)


def model_type(model: nn.Module) -> str | None:
    """The `model_type` of a transformers model (PEFT-wrapped or not): whose record's part
    names `part_of` reads first."""
    return getattr(getattr(model, "config", None), "model_type", None)


def freeze(model: nn.Module, spec: TrainingSpec) -> None:
    """requires_grad per `spec.train` (LoRA: everything frozen, adapters added later).

    Parts come from the parameter names (`models.build.part_of`), so a VLM family without
    closed forms freezes its vision tower / projector / language model as LLaVA does; the
    analytic tier's own checks (`build_graph`) refuse the same modes for its families first."""
    mt = model_type(model)
    parts = {part_of(n, mt) for n, _ in model.named_parameters()}
    if spec.train not in DECODER_TRAINS and "vision_tower" not in parts:
        raise SpecError("train", spec.train, DECODER_TRAINS,
                        reason="a decoder-only model has no vision tower or projector")
    if spec.train == "projector" and "multi_modal_projector" not in parts:
        raise SpecError("train", spec.train, ("full", "llm+projector", "lora", "peft"),
                        reason=f"no projector module found in {type(model).__name__}")
    trained = TRAINABLE_MODULES[spec.train]  # the model graph's table (LLaVA recipes)
    for name, p in model.named_parameters():
        p.requires_grad_(part_of(name, mt) in trained)


def llm_linear_names(model: nn.Module) -> tuple[str, ...]:
    """Leaf names of the language model's linear layers (`nn.Linear`, and GPT-2-style
    `Conv1D`, which PEFT's LoRA also wraps), lm_head excluded: PEFT's `all-linear`
    (peft/tuners/tuners_utils.py `_maybe_include_all_linear_layers` skips the output layer)."""
    from transformers.pytorch_utils import Conv1D

    mt = model_type(model)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, (nn.Linear, Conv1D)) and part_of(n, mt) == "language_model"}
    return tuple(sorted(names | _moe_expert_names(model)))


def _moe_expert_names(model: nn.Module) -> set[str]:
    """The transformers-4 names of fused MoE experts and routers (Mixtral's w1/w2/w3, gate),
    which PEFT's `all-linear` adds and maps onto the fused v5 parameters (`target_parameters`;
    peft/utils/transformers_weight_conversion.py `_MOE_TARGET_MODULE_MAPPING`, private: absent
    in another PEFT version, the experts simply get no adapters)."""
    try:
        from peft.utils.transformers_weight_conversion import (
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_TARGET_MODULE_MAPPING,
        )
    except ImportError:
        return set()
    base = _MODEL_TO_CONVERSION_PATTERN.get(getattr(model.config, "model_type", None))
    return set(_MOE_TARGET_MODULE_MAPPING.get(base, {}))


def lora_targets_for(model: nn.Module, spec: TrainingSpec, config) -> TrainingSpec:
    """The spec with the LoRA targets the default means for this model
    (`job.lora_targets.default_targets` over `llm_linear_names`). Explicit targets stay as given."""
    if spec.train != "lora":
        return spec
    return spec.with_(lora=default_targets(spec.lora, llm_linear_names(model)))


def _tuner_layers_with_own_move() -> list[type]:
    """BaseTunerLayer and every PEFT tuner layer class overriding its adapter move."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out, todo = [], [BaseTunerLayer]
    while todo:
        cls = todo.pop()
        if "_move_adapter_to_device_of_base_layer" in cls.__dict__:
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


@contextlib.contextmanager
def _no_device_moves():
    """PEFT moves new adapters and replaced modules with `.to()`; on fake parameters that swap
    fails, and everything is already on the (CPU) device, so device-only moves are skipped.

    The skipped move would also cast adapters to the base dtype, which PEFT's
    `autocast_adapter_dtype=True` (the default) casts back to fp32 right after: building them
    in fp32 (`default_dtype`) ends in the same tensors."""
    classes = _tuner_layers_with_own_move()
    saved = {cls: cls.__dict__["_move_adapter_to_device_of_base_layer"] for cls in classes}
    module_to = nn.Module.to

    def to_device_only(self, *args, **kwargs):
        """`Module.to(device)` is a no-op here (all fakes are on CPU); dtype changes still run."""
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return self if dtype is None else module_to(self, *args, **kwargs)

    for cls in classes:
        cls._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    nn.Module.to = to_device_only
    try:
        yield
    finally:
        for cls, move in saved.items():
            cls._move_adapter_to_device_of_base_layer = move
        nn.Module.to = module_to


def _module_copy(obj, memo=None):
    """`copy.deepcopy` whose tensors are cloned in the active tensor mode: deep-copying a
    FakeTensor makes a new FakeTensorMode ("Mixing fake modes"); a clone is what a CUDA
    deepcopy allocates (one new storage per parameter and buffer)."""
    memo = {} if memo is None else memo
    if isinstance(obj, nn.Module):
        for p in obj.parameters():
            memo.setdefault(id(p), nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        for b in obj.buffers():
            memo.setdefault(id(b), b.clone())
    return copy.deepcopy(obj, memo)


@contextlib.contextmanager
def _fake_safe_module_copies():
    """PEFT `ModulesToSaveWrapper` (modules_to_save, trainable_token copies) deep-copies the
    original module (peft/utils/other.py `copy.deepcopy(self.original_module)`)."""
    import types

    from peft.utils import other

    saved = other.copy
    other.copy = types.SimpleNamespace(deepcopy=_module_copy, copy=copy.copy)
    try:
        yield
    finally:
        other.copy = saved


@contextlib.contextmanager
def scalar_branches():
    """`bool(t)` / `t.item()` of a one-element fake or meta tensor is True / 1.0.

    PEFT LyCORIS layers (LoHa, LoKr) draw `torch.rand(1) > module_dropout` in every training
    forward (peft/tuners/loha/layer.py): a host-side branch, no device memory, whose value a
    fake tensor does not have. With module_dropout = 0 (the default) it is always True."""
    item, as_bool = torch.Tensor.item, torch.Tensor.__bool__

    def fake(self):
        return isinstance(self, FakeTensor) or self.is_meta

    torch.Tensor.item = lambda self: 1.0 if fake(self) else item(self)
    torch.Tensor.__bool__ = lambda self: True if fake(self) else as_bool(self)
    try:
        yield
    finally:
        torch.Tensor.item, torch.Tensor.__bool__ = item, as_bool


def _check_lora_targets(model: nn.Module, spec: TrainingSpec) -> None:
    pattern = lora_llm_pattern(spec.lora.targets)
    if not any(re.match(pattern, n) for n, _ in model.named_modules()):
        raise SpecError("lora.targets", spec.lora.targets,
                        sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                if isinstance(m, nn.Linear)}),
                        reason="no language-model linear layer has these names")


def add_adapters(model: nn.Module, spec: TrainingSpec) -> nn.Module:
    """Wrap with the spec's PEFT adapters (`adapters.build_peft_config`: LoRA/DoRA on the
    language model's linears in `spec.lora.targets`, or any method of `spec.peft_config`).

    A method PEFT cannot build on this model is a one-line `SpecError` naming it."""
    import peft

    cfg = build_peft_config(spec)
    if spec.train == "lora":
        _check_lora_targets(model, spec)
    if spec.quantize != "none" and hasattr(cfg, "_register_custom_module"):
        from hybridmem.trace import quantized

        layer = quantized.lora_layer_class()  # peft's bnb LoRA forward on the emulated layers
        cfg._register_custom_module({quantized.Linear4bit: layer, quantized.Linear8bitLt: layer})
    # PEFT keeps adapter weights in fp32 (`autocast_adapter_dtype=True`): build them so;
    # half adapters are the base's dtype, which `autocast_adapter_dtype=False` leaves them in
    half = spec.adapter_dtype != "fp32"
    with _no_device_moves(), _fake_safe_module_copies(), \
            default_dtype(AXIS_DTYPE[spec.adapter_dtype]), warnings.catch_warnings():
        # peft calls transformers' deprecated `is_gradient_checkpointing`: not the user's concern
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return peft.get_peft_model(model, cfg, **({"autocast_adapter_dtype": False}
                                                      if half else {}))
        except Exception as err:  # noqa: BLE001 - any refusal of PEFT's is the user's config
            if spec.train == "lora":
                raise
            raise build_error(spec, err) from err


add_lora = add_adapters  # the LoRA-only name callers used before train='peft'


def apply_loss(model: nn.Module, spec: TrainingSpec, config) -> str | None:
    """The job's techniques patched into the instance, emulated as their libraries patch it
    (`hybridmem.techniques.install`: Liger's kernels as Trainer's `apply_liger_kernel` does,
    torchtune's chunked loss, Cut Cross-Entropy); returns the text model type whose RoPE the
    run patches (Liger's), or None."""
    from hybridmem import techniques
    from hybridmem.families import target

    text = getattr(getattr(config, "text_config", None), "model_type", None)
    return techniques.install(model, spec, target(config.model_type, text))


def top_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Top-level part name -> module (vision tower, projector, language model, lm_head).

    The vision tower and projector are the outermost modules whose names map to them
    (`part_of`), found in the model's own module tree: LLaVA's `model.vision_tower`,
    Qwen2-VL's `model.visual` (its `merger` nested inside, the projector: the tracker's part
    stack attributes the merger's births to it), Idefics3's `model.vision_model`/`connector`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = {"language_model": base.get_decoder(), "lm_head": base.get_output_embeddings()}
    for name, module in base.named_modules():  # pre-order: a parent comes before its children
        part = part_of(name, model_type(base))
        if name and part in ("vision_tower", "multi_modal_projector") and part not in out:
            out[part] = module
    return {part: m for part, m in out.items() if m is not None}
