"""The training job a measurement runs: model from config, frozen parts, LoRA, optimizer, batch.

It follows the same conventions as the trace tier (`hybridmem.trace.runner`), so that a measured
row and a traced row describe the same job: HF's own loss from `labels`, outputs dropped before
backward (`loop="trainer"`) or held until the next forward returns (`loop="custom"`), the loss
divided by `grad_accum`, `clip_grad_norm_(foreach=True)` before the step when `max_grad_norm`
> 0, `zero_grad(set_to_none=True)`, `torch.cuda.empty_cache()` where `spec.empty_cache_at` says
(the child calls it; `empty_cache_steps` > 0), LoRA adapters on the language model's linears only,
image tokens right after BOS and masked out of the labels, no attention mask (unpadded batch).
Objectives beyond SFT run the trace tier's step functions (`hybridmem.objectives.steps`: the
TRL trainers' code paths) on the real model: one code path for both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridmem.families.defaults import as_job
from hybridmem.job.spec import TrainingSpec
from hybridmem.models.build import TRAINABLE_MODULES, part_of
from hybridmem.torch_dtype import AUTOCAST, PARAM_DTYPE, default_dtype


class Unavailable(RuntimeError):
    """The job needs something this machine lacks (bitsandbytes, flash-attn): an `error` row."""


@dataclass
class Job:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: dict
    params: list[nn.Parameter]
    masters: list[torch.Tensor] = field(default_factory=list)
    scaler: object | None = None
    engine: object | None = None
    """A DeepSpeed engine (ZeRO): it runs backward and the step itself."""
    outputs: object | None = None
    """The output object `loop="custom"` holds: the last forward's, until the next returns."""
    offload: object | None = None
    """The context each forward runs in (`techniques.loop_context`: TRL's activation
    offloading for `offload_activations="all"`), else None."""
    ref: nn.Module | None = None
    """The separate reference model of an objective beyond SFT (`objectives.steps`)."""
    fused: bool = False
    """The step runs TRL's fused LM head (`objectives.steps.uses_fused_head`): on a GPU,
    TRL's own Triton kernels."""
    tracker: object | None = None
    """Unused here: the trace tier's tracker, which `objectives.steps` relabels parts on."""
    grpo: dict | None = None
    """GRPO's generated ids, advantages and reference log-probs for the step's micro-steps."""
    generated: bool = False
    micro: int = 0
    """The micro-step running (GRPO's slice of its generation batch)."""
    step_context: object | None = None
    """`step_context(batch)`: the context one micro-step's forward and backward run in,
    yielding the batch they see (torch's `context_parallel`, `distributed.model_parallel`)."""
    in_step: object | None = None
    """The entered `step_context` of the micro-step running (its exit stack)."""


def build_model(spec: TrainingSpec, config, device: torch.device) -> nn.Module:
    """Random-weight model built directly on `device` in the spec's parameter dtype."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    spec = as_job(spec)  # a Job as it is (the child's); a plain spec's defaults filled
    dtype = PARAM_DTYPE[spec.precision]
    try:
        # `dtype=` explicitly: a config's own `torch_dtype` (llava-1.5-7b's is float16) would
        # otherwise override the default dtype (transformers `_from_config`)
        with torch.device(device), default_dtype(dtype):
            model = auto.from_config(config, attn_implementation=spec.attn, dtype=dtype)
    except ImportError as err:  # e.g. flash_attention_2 without the flash-attn package
        raise Unavailable(f"attn={spec.attn!r} unavailable: {err}") from err
    return model.to(device).train()


def freeze(model: nn.Module, spec: TrainingSpec) -> None:
    for name, p in model.named_parameters():
        # the same parts train as in the analytic and trace tiers (LLaVA-NeXT's image_newline
        # trains with the LLM, not in projector-only stage 1)
        p.requires_grad_(part_of(name) in TRAINABLE_MODULES[spec.train])


def add_lora(model: nn.Module, spec: TrainingSpec) -> nn.Module:
    """The spec's PEFT adapters (adapters in fp32, PEFT's default, or with `adapter_dtype`
    half in the base's dtype: `autocast_adapter_dtype=False`): LoRA/DoRA on the non-vision
    linears named in `spec.lora.targets` (the default: the model's own LLM linear names), or
    any method of `spec.peft_config`; the same config the trace tier builds
    (`adapters.build_peft_config`)."""
    import peft

    from hybridmem.adapters import build_error, build_peft_config
    from hybridmem.trace.model import lora_targets_for

    # the default targets mean the family's own linear names (Phi-3's qkv_proj / gate_up_proj),
    # one rule for the model graph, the trace tier and here (`job.lora_targets.default_targets`)
    spec = lora_targets_for(model, spec, None)
    cfg = build_peft_config(spec)
    keep = {"autocast_adapter_dtype": False} if spec.adapter_dtype != "fp32" else {}
    try:
        return peft.get_peft_model(model, cfg, **keep)
    except Exception as err:  # noqa: BLE001 - PEFT refused the user's adapter config
        if spec.train == "lora":
            raise
        raise build_error(spec, err) from err


def make_optimizer(name: str, params: list[torch.Tensor], model: nn.Module | None = None,
                   lora=None, device: torch.device | None = None) -> torch.optim.Optimizer:
    """The optimizer as users get it, from the registry (`hybridmem.job.optimizers`): on CUDA
    the real library (torch; transformers' Adafactor; bitsandbytes for 8-bit / paged / bnb Lion,
    imported lazily), on the CPU stand-in the rule's layout emulation; for `lora-fa` the
    registry's `LoraFA.build_from_model` (it takes the PeftModel and freezes every lora_A, so
    build it before collecting `params`)."""
    from hybridmem.job.optimizers import rule

    if name == "lora-fa":
        return rule(name).build_from_model(model, lora)
    cuda = device is None or torch.device(device).type == "cuda"
    try:
        return rule(name).build(params, cuda=cuda)
    except ImportError as err:  # bitsandbytes missing on the GPU machine: an `error` row
        raise Unavailable(str(err).splitlines()[0]) from err


def make_batch(spec: TrainingSpec, config, model: nn.Module | None, device) -> dict:
    """The trace tier's batch (`trace.inputs.make_batch`: the same shapes, image tokens and
    pixel inputs), on `device`, pixel inputs in the parameter dtype, every tensor where a real
    collator puts it (no host-side shape inputs)."""
    from hybridmem.trace.inputs import make_batch as batch_of

    spec = as_job(spec)  # a Job as it is (the child's); a plain spec's defaults filled
    return batch_of(spec, config, model, PARAM_DTYPE[spec.precision], device,
                    host_shapes=False)[0]


def quantize_bnb(model: nn.Module, spec: TrainingSpec, device) -> int:
    """Quantise the base weights for real with bitsandbytes, as transformers'
    `replace_with_bnb_linear` + loading does (no hub download: the random weights in place):
    every nn.Linear the rules convert (`hybridmem.techniques.quantize.Quant.converts`) becomes a
    `bnb.nn.Linear4bit` / `Linear8bitLt` whose weight is quantised when moved to `device`
    (`Params4bit.to` / `Int8Params.to` call `_quantize`); then peft's
    `prepare_model_for_kbit_training(use_gradient_checkpointing=False)` when `kbit_prep`
    (checkpointing is switched on by the caller, as for any spec). Returns the count."""
    from hybridmem.techniques.quantize import quant_of

    quant = quant_of(spec)
    if quant is None:
        return 0
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise Unavailable(f"quantize={spec.quantize!r} needs bitsandbytes, which is not "
                          "installed") from err
    compute = getattr(torch, quant.compute_dtype)
    storage = getattr(torch, spec.quant_storage)
    todo = [(n, m) for n, m in model.named_modules()
            if type(m) is nn.Linear and quant.converts(n)]
    for name, m in todo:
        if quant.four_bit:
            new = bnb.nn.Linear4bit(m.in_features, m.out_features, m.bias is not None, compute,
                                    compress_statistics=quant.double_quant,
                                    quant_type=quant.method, quant_storage=storage,
                                    device="meta")
            new.weight = bnb.nn.Params4bit(m.weight.data, requires_grad=False,
                                           compress_statistics=quant.double_quant,
                                           quant_type=quant.method, quant_storage=storage)
        else:
            # BitsAndBytesConfig defaults: llm_int8_threshold 6.0, has_fp16_weights False
            new = bnb.nn.Linear8bitLt(m.in_features, m.out_features, m.bias is not None,
                                      has_fp16_weights=False, threshold=6.0, device="meta")
            new.weight = bnb.nn.Int8Params(m.weight.data, requires_grad=False,
                                           has_fp16_weights=False)
        new.bias = m.bias
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, new.to(device))
        m.weight = None  # the unquantised weight is freed
    model.is_loaded_in_4bit, model.is_loaded_in_8bit = quant.four_bit, not quant.four_bit
    if quant.kbit_prep:
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return len(todo)


def build_trainable(spec: TrainingSpec, config, device,
                    build_context=contextlib.nullcontext) -> nn.Module:
    """The model as it trains on one GPU: built (inside `build_context()`, e.g. DeepSpeed's
    `zero.Init`), parts frozen, LoRA added, checkpointing on."""
    with build_context():
        model = build_model(spec, config, device)
    freeze(model, spec)
    quantize_bnb(model, spec, device)  # --quantize: bitsandbytes for real (QLoRA)
    if spec.train in ("lora", "peft"):
        model = add_lora(model, spec)
    apply_loss(model, spec, config, device)  # Trainer: after PEFT, before checkpointing
    if spec.grad_ckpt:
        from hybridmem.job.checkpointing import enable_checkpointing
        enable_checkpointing(model, spec)  # the trace tier's call, incl. --grad-ckpt-policy
        from hybridmem import techniques

        techniques.checkpointed(model, spec, torch.device(device).type)  # ckpt-inputs' port
    return model


def apply_loss(model: nn.Module, spec: TrainingSpec, config, device) -> None:
    """The job's techniques: on CUDA each library itself as the trainer applies it
    (`hybridmem.techniques.apply_real`: liger-kernel, cut-cross-entropy, torchtune's chunked
    loss in plain torch; a missing package is an `Unavailable` row); on the CPU stand-in the
    trace tier's emulated kernels (`trace.model.apply_loss`), RoPE patched for the rest of this
    (one-job) process as Liger's own patch is."""
    from hybridmem import techniques
    from hybridmem.techniques.liger_kernels import rope_patched

    if device.type != "cuda":
        from hybridmem.trace.model import apply_loss as emulated

        text = emulated(model, spec, config)
        if text is not None:
            rope_patched(text).__enter__()  # noqa: SIM115 - process-wide, as Liger's
        return
    try:
        techniques.apply_real(model, spec)
    except ImportError as err:
        raise Unavailable(str(err)) from err


def prepare(spec: TrainingSpec, config, device) -> Job:
    """Everything on `device`; `bf16-master` emulates DeepSpeed's BF16_Optimizer (see README).

    One GPU; a multi-rank spec goes to `hybridmem.harness.distributed.prepare` (the child)."""
    model = build_trainable(spec, config, device)
    job = finish_job(model, spec, device)
    from hybridmem import objectives
    from hybridmem.objectives import steps

    job.fused = steps.uses_fused_head(spec)
    if job.fused:  # SFT / DPO / KTO trainers at TRL >= 1.15: TRL's own head on the model
        steps.add_fused_head(model, spec)
    if not objectives.lm_loss(spec):  # the TRL trainer's batch and reference (its step)
        objectives.check_model(spec, 0, config.model_type)
        job.batch = objectives.batch(spec, device, fused=job.fused)
        job.ref = steps.reference_model(
            spec, config, lambda s, c: build_model(s, c, device))
        if job.fused:
            steps.add_fused_reference_head(job.ref)
        return job
    job.batch = make_batch(spec, config, model, device)
    if job.fused:
        job.batch = objectives.collate(spec, job.batch)
    return job


def generation(job: Job, spec: TrainingSpec) -> None:
    """The objective's generation phase of a step (GRPO's, `objectives.prepare`: the full
    sampling loop), before its first micro-step; a no-op for the other objectives."""
    from hybridmem import objectives

    objectives.prepare(job, spec, every_step=True)


def end_step(job: Job) -> None:
    """GRPO's generation buffers die with the step (`trace.runner.train`); the next step's
    micro-steps count from 0."""
    job.grpo, job.micro = None, 0


def finish_job(model: nn.Module, spec: TrainingSpec, device, batch: dict | None = None) -> Job:
    """Optimizer (on fp32 masters under `bf16-master`) and loss scaler for `model`."""
    lorafa = make_optimizer("lora-fa", [], model, spec.lora) if spec.optimizer == "lora-fa" \
        else None  # freezes lora_A before the trainable params are taken
    params = [p for p in model.parameters() if p.requires_grad]
    # fp32 master copies of the trainable bf16 params; the optimizer steps on them
    masters = ([p.detach().float().requires_grad_(True) for p in params]
               if spec.precision == "bf16-master" else [])
    from hybridmem import techniques

    # optimizer-in-backward: torchtune's hooks, one optimizer per parameter
    optimizer = techniques.optimizer(
        spec, params, lambda ps: make_optimizer(spec.optimizer, ps, device=device))
    if optimizer is None:
        optimizer = lorafa if lorafa is not None else make_optimizer(
            spec.optimizer, masters or params, device=device)
    scaler = torch.amp.GradScaler(device.type) if spec.precision == "fp16-mixed" else None
    job = Job(model, optimizer, batch or {}, params, masters, scaler)
    job.offload = techniques.loop_context(model, spec, device)  # offload "all": TRL's context
    return job


def _call(job: Job, spec: TrainingSpec) -> torch.Tensor:
    from hybridmem import objectives

    if not objectives.lm_loss(spec) or job.fused:  # the TRL trainer's compute_loss (step.loss)
        loss = objectives.loss(job, spec, job.micro)
        job.micro += 1
        return loss
    if spec.loop == "custom":  # `outputs = model(**batch)`: the previous object dies here
        job.outputs = job.model(**job.batch)
        return job.outputs.loss
    return job.model(**job.batch).loss  # Trainer: the output (and its logits) is dropped here


def forward(job: Job, spec: TrainingSpec, device) -> torch.Tensor:
    if job.step_context is not None:  # entered here, left when the backward has run
        job.in_step = contextlib.ExitStack()
        whole = job.batch
        job.batch = job.in_step.enter_context(job.step_context(whole))
        job.in_step.callback(setattr, job, "batch", whole)
    ctx = (torch.autocast(device.type, dtype=AUTOCAST[spec.precision])
           if spec.precision in AUTOCAST else contextlib.nullcontext())
    with ctx, job.offload if job.offload is not None else contextlib.nullcontext():
        return _call(job, spec)


def backward(job: Job, loss: torch.Tensor, spec: TrainingSpec | None = None) -> None:
    if spec is not None and spec.grad_accum > 1:  # Trainer.training_step: loss / steps
        loss = loss / spec.grad_accum
    if job.engine is not None:
        job.engine.backward(loss)
        return
    (job.scaler.scale(loss) if job.scaler else loss).backward()
    if job.in_step is not None:
        job.in_step.close()
        job.in_step = None


def clip(job: Job, spec: TrainingSpec) -> None:
    """`clip_grad_norm_(foreach=True)` on what the optimizer steps (the fp32 masters under
    bf16-master), after GradScaler's unscale_ (as Trainer / accelerate do); CUDA's default is
    foreach, given explicitly so a CPU run takes the same path."""
    if job.scaler:
        job.scaler.unscale_(job.optimizer)
    torch.nn.utils.clip_grad_norm_(job.masters or job.params, spec.max_grad_norm, foreach=True)


def empty_cache(device) -> None:
    """`torch.cuda.empty_cache()` where `spec.empty_cache_at` places it (no-op off CUDA)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def optimizer_step(job: Job, spec: TrainingSpec | None = None, empty_cache_device=None) -> None:
    """The step (clipping first), then `zero_grad(set_to_none=True)`; `empty_cache_device`
    set: `torch.cuda.empty_cache()` between the two (the peft benchmark's place,
    `spec.empty_cache_at` == "after_step")."""
    clipping = spec is not None and spec.max_grad_norm > 0
    if job.engine is not None:  # DeepSpeed: step (clipping per its own config), zero grads
        job.engine.step()
        empty_cache(empty_cache_device)
        return
    if job.masters:
        with torch.no_grad():  # BF16_Optimizer: bf16 grads -> fp32 master grads, step, copy back
            for m, p in zip(job.masters, job.params):
                if p.grad is not None:
                    m.grad = p.grad.float()
                    p.grad = None
        if clipping:
            clip(job, spec)
        job.optimizer.step()
        with torch.no_grad():
            for m, p in zip(job.masters, job.params):
                p.copy_(m)
    elif job.scaler:
        if clipping:
            clip(job, spec)
        job.scaler.step(job.optimizer)
        job.scaler.update()
    else:
        if clipping:
            clip(job, spec)
        job.optimizer.step()
    empty_cache(empty_cache_device)
    job.optimizer.zero_grad(set_to_none=True)
    job.model.zero_grad(set_to_none=True)
