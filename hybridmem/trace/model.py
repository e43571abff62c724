"""Build the real `transformers` model for a spec under FakeTensorMode (no weights, no memory).

Traps handled here (DESIGN.md, "Facts measured or read"): fake `cuda` tensors do not work on a
CPU-only build, so tensors are CPU fakes; `model.to(dtype)` fails on fake parameters, so the
parameter dtype comes from `torch.set_default_dtype`; `peft.get_peft_model` moves adapters with
`.to()`, which fails the same way, so that move is skipped (the adapters are already created on
the base layer's device).
"""

from __future__ import annotations

import copy
import re
import warnings

import torch
from torch import nn

from hybridmem.errors import SpecError, UnsupportedModelError
from hybridmem.models.build import DECODER_TRAINS, TRAINABLE_MODULES, part_of
from hybridmem.spec import TrainingSpec
from hybridmem.torch_dtype import PARAM_DTYPE, default_dtype

def attn_for_cpu(attn: str) -> str:
    """FlashAttention-2 has no CPU kernel; its memory behaviour is SDPA's flash backend's."""
    return "sdpa" if attn == "flash_attention_2" else attn


def build_model(spec: TrainingSpec, config) -> nn.Module:
    """The HF model for `config`, its parameters fake, in the spec's parameter dtype."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    dtype = PARAM_DTYPE[spec.precision]
    # from_config writes `dtype` into the config (and would use the preset's `torch_dtype`
    # without it): work on a copy, with the spec's dtype given explicitly.
    config = copy.deepcopy(config)
    with default_dtype(dtype), no_init_weights():
        try:
            model = auto.from_config(config, dtype=dtype,
                                     attn_implementation=attn_for_cpu(spec.attn))
        except Exception as err:  # the model's own code refused to build under fake tensors
            raise UnsupportedModelError(
                "model", spec.model,
                reason=f"its code cannot be built under fake tensors ({type(err).__name__}: "
                f"{err}); use --method analytic") from err
    # `no_init_weights` also skips tying: tie as `from_pretrained`/`post_init` would (Llama-3.2
    # ties lm_head to embed_tokens; untied it would count 394M parameters twice)
    model.tie_weights()
    model.train()
    return model


def freeze(model: nn.Module, spec: TrainingSpec) -> None:
    """requires_grad per `spec.train` (LoRA: everything frozen, adapters added later)."""
    has_vision = any("vision_tower" in n for n, _ in model.named_parameters())
    if spec.train == "projector" and not has_vision:
        raise SpecError("train", spec.train, DECODER_TRAINS,
                        reason="a decoder-only model has no projector")
    trained = TRAINABLE_MODULES[spec.train]  # the model graph's table (LLaVA recipes)
    for name, p in model.named_parameters():
        p.requires_grad_(part_of(name) in trained)


def add_lora(model: nn.Module, spec: TrainingSpec) -> nn.Module:
    """Wrap with PEFT LoRA on the language model's linear layers named in `spec.lora.targets`."""
    import peft
    from peft.tuners.lora import layer as lora_layer

    lora = spec.lora
    # Only the LLM gets adapters (CLIP also has q/k/v_proj): the LLaVA finetune_lora recipe.
    pattern = r"^(?!.*vision_tower).*\.(" + "|".join(map(re.escape, lora.targets)) + r")$"
    cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=pattern, bias="none")
    names = [n for n, _ in model.named_modules()]
    if not any(re.match(pattern, n) for n in names):
        raise SpecError("lora.targets", lora.targets,
                        sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                if isinstance(m, nn.Linear)}),
                        reason="no language-model linear layer has these names")
    move = lora_layer.LoraLayer._move_adapter_to_device_of_base_layer
    module_to = nn.Module.to

    def to_device_only(self, *args, **kwargs):
        """`Module.to(device)` is a no-op here (all fakes are on CPU); dtype changes still run."""
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return self if dtype is None else module_to(self, *args, **kwargs)

    # PEFT moves new adapters and replaced modules with `.to()`; on fake parameters that swap
    # fails, and everything is already on the (CPU) device, so device-only moves are skipped.
    lora_layer.LoraLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    nn.Module.to = to_device_only
    try:
        # PEFT keeps adapter weights in fp32 (`autocast_adapter_dtype=True`): build them so.
        with default_dtype(torch.float32), warnings.catch_warnings():
            # peft calls transformers' deprecated `is_gradient_checkpointing`: not the user's concern
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(model, cfg)
    finally:
        lora_layer.LoraLayer._move_adapter_to_device_of_base_layer = move
        nn.Module.to = module_to


def enable_checkpointing(model: nn.Module) -> None:
    """The model's own activation checkpointing (non-reentrant, transformers' default)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable()


def top_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Top-level part name -> module (vision tower, projector, language model, lm_head)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = {"language_model": base.get_decoder(), "lm_head": base.get_output_embeddings()}
    inner = getattr(base, "model", None)
    for part in ("vision_tower", "multi_modal_projector"):
        if inner is not None and hasattr(inner, part):
            out[part] = getattr(inner, part)
    return out
