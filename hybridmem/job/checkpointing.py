"""Activation checkpointing switched on the one way the trace tier and the CUDA harness share.

transformers 5.x gives `activation_checkpointing_enable()` and the deprecated
`gradient_checkpointing_enable(use_reentrant=False)` the same effect (modeling_utils.py
`_activation_checkpointing_enable`: kwargs default `{"use_reentrant": False}`); transformers
4.x has only `gradient_checkpointing_enable`, whose default is `{"use_reentrant": True}`
(4.57 modeling_utils.py): the job asks for non-reentrant checkpointing on every release (the
5.x default; on 4.x TrainingArguments `gradient_checkpointing_kwargs={"use_reentrant": False}`,
docs/trace.md "Versions"). One function keeps the trace tier and the harness on one call.
"""

from __future__ import annotations

from torch import nn

from hybridmem.job.spec import TrainingSpec, ckpt_layer


def enable_checkpointing(model: nn.Module, spec: TrainingSpec) -> list[str]:
    """The model's own activation checkpointing (non-reentrant, transformers' default), on the
    layers `spec.grad_ckpt_policy` picks; returns the checkpointed layers' names.

    `activation_checkpointing_enable()` turns on every GradientCheckpointingLayer
    (modeling_utils.py `_set_gradient_checkpointing`, which also hands each its
    `_gradient_checkpointing_func`); each layer then checks its own `gradient_checkpointing`
    attribute in `__call__` (transformers/modeling_layers.py `GradientCheckpointingLayer`), so
    switching that attribute off leaves the layer to run and save as without checkpointing.
    The layers are counted in `modules()` order, as `_set_gradient_checkpointing` counts them
    for its own `every_n_layers`, by `spec.ckpt_layer`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # `--training-args` activation_checkpointing_kwargs.offload: transformers' own
    # save_on_cpu(pin_memory=True) around each checkpoint (techniques.offload "ckpt-inputs"; the
    # trace tier replaces it by a port that works on meta tensors, offload_hooks.enable_ckpt_offload)
    from hybridmem import techniques

    kwargs = techniques.checkpoint_kwargs(spec)  # torchtitan's op-level policy (techniques.sac)
    offload = spec.offload_activations == "ckpt-inputs"
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(kwargs, offload=offload)
    else:  # transformers 4.x; the job's checkpointing is non-reentrant on every release
        if offload:
            from hybridmem.environment import installed
            from hybridmem.errors import SpecError

            raise SpecError("offload_activations", "ckpt-inputs", reason="checkpoint offload "
                            "is transformers>=5.0's activation_checkpointing_enable(offload=True);"
                            f" installed: transformers {installed('transformers')}")
        base.gradient_checkpointing_enable(kwargs or {"use_reentrant": False})
    return select_checkpointed(base, spec)


def select_checkpointed(model: nn.Module, spec: TrainingSpec) -> list[str]:
    """Leave checkpointing on only in the layers `ckpt_layer` picks (after transformers'
    enable turned it on in all); the names of those kept on. Also the CUDA harness's."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, (_, layer) in enumerate(layers):
        layer.gradient_checkpointing = ckpt_layer(spec, i)
    return [n for n, layer in layers if layer.gradient_checkpointing]
