"""`hybridmem predict`: options -> TrainingSpec -> predict() -> table / JSON / plot.

Option names are a contract other tools script against (issue #2); keep them stable.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU, custom_gpu, gpu_by_name
from hybridmem.job.optimizers import OPTIMIZERS
from hybridmem.predict import TRACE_ONLY_METHOD, trace_only_reason

# `--optimizer` help: every registry entry with its one-line summary (hybridmem/job/optimizers.py)
OPTIMIZER_HELP = "; ".join(f"{n} ({r.summary})" for n, r in OPTIMIZERS.items() if n != "adamw")


def resolve_gpu(gpu: str | None, gpu_mem: float | None) -> GPU | None:
    if gpu is not None and gpu_mem is not None:
        raise SpecError("gpu", gpu, reason="give --gpu or --gpu-mem, not both")
    if gpu is not None:
        return gpu_by_name(gpu)
    if gpu_mem is not None:
        return custom_gpu(gpu_mem)
    return None


def resolve_method(method: str | None, spec=None) -> str:
    """The tier to use: the user's; else the trace tier for what only it prices (a non-LoRA
    PEFT adapter, a family without closed forms); else hybrid only when a calibrated model
    fits (issue 5)."""
    if method is not None:
        return method
    if spec is not None and trace_only_reason(spec) is not None:
        return TRACE_ONLY_METHOD
    try:
        from hybridmem.learned.predictor import default_method
    except ImportError:  # the `learned` extra is not installed
        return "analytic"
    return default_method(spec=spec)


def _method_note(result, chosen: str, given: str | None, spec):
    """Say so in the notes when the tier was picked because only it prices the spec."""
    import dataclasses

    reason = trace_only_reason(spec) if given is None and chosen == TRACE_ONLY_METHOD else None
    if reason is not None:
        note = f"method: {TRACE_ONLY_METHOD} chosen because {reason} (pass --method to override)"
        return dataclasses.replace(result, notes=(*result.notes, note))
    return result


def predict_command(
    model: str = typer.Option(..., "--model", help="Preset name or path to a HF config.json (or its folder); families without closed forms: trace tier."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Samples per GPU per step (default 1)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sample, image tokens included (default 2048)."),
    images_per_sample: Optional[int] = typer.Option(None, "--images-per-sample", help="Default: 1 for multimodal models, 0 for LLMs."),
    image_size: Optional[str] = typer.Option(None, "--image-size", help="Image side in pixels, or HxW for native-resolution families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral-3 / Pixtral) and image-splitting ones (Idefics3, SmolVLM: the resized image; InternVL: the input image); default: the vision tower's (Idefics3, SmolVLM: the processor's resize side, default the size the checkpoint records, else 4 tiles; InternVL: the input image, tiled into 1-12 tiles + thumbnail, default one tile; Mistral-3: the input image, shrunk to the longest edge, default a longest-edge square)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32, bf16, fp16, bf16-mixed (default), fp16-mixed, bf16-master."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adamw (default: torch foreach AdamW); " + OPTIMIZER_HELP + "."),
    grad_ckpt: Optional[bool] = typer.Option(None, "--grad-ckpt/--no-grad-ckpt", help="Gradient checkpointing (default off)."),
    grad_ckpt_policy: Optional[str] = typer.Option(None, "--grad-ckpt-policy", help="With --grad-ckpt: full (default, every layer) or every:N (layers 0, N, 2N, ...)."),
    train: Optional[str] = typer.Option(None, "--train", help="full (default), llm+projector, projector, lora; peft comes with --peft-config."),
    lora_r: Optional[int] = typer.Option(None, "--lora-r", help="LoRA rank (default 8)."),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help="LoRA alpha (default 16)."),
    lora_targets: Optional[str] = typer.Option(None, "--lora-targets", help="Comma-separated module names (default: all LLM linear layers)."),
    attn: Optional[str] = typer.Option(None, "--attn", help="eager, sdpa (default), flash_attention_2."),
    peft_config: Optional[str] = typer.Option(None, "--peft-config", help="PEFT adapter_config.json (LoRA/DoRA: analytic; any other method: trace)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="Frozen base weights quantised with bitsandbytes: none (default), nf4 (QLoRA, double quant), fp4, int8; needs --train lora or --peft-config."),
    quantization_config: Optional[str] = typer.Option(None, "--quantization-config", help="BitsAndBytesConfig JSON (or a config.json carrying quantization_config)."),
    kbit_prep: Optional[bool] = typer.Option(None, "--kbit-prep/--no-kbit-prep", help="With --quantize: peft prepare_model_for_kbit_training ran (fp32 casts of unquantised params; default on)."),
    loop: Optional[str] = typer.Option(None, "--loop", help="trainer (default: only the loss outlives the forward) or custom (outputs live through backward)."),
    max_grad_norm: Optional[float] = typer.Option(None, "--max-grad-norm", help="clip_grad_norm_ before the step; 0 = off (default; Trainer files: 1.0)."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-steps accumulated per optimizer step (default 1)."),
    optimizer_in_backward: Optional[bool] = typer.Option(None, "--optimizer-in-backward/--no-optimizer-in-backward", help="Step each parameter inside backward as its gradient is ready (torchtune optimizer_in_bwd); no grad accumulation or clipping, one GPU."),
    offload_activations: Optional[str] = typer.Option(None, "--offload-activations", help="Saved activations in host memory: all (TRL SFTConfig activation_offloading: every saved tensor >= 1 KiB but the lm_head's), ckpt-inputs (transformers checkpointing offload=True: the checkpointed layers' inputs; needs --grad-ckpt), none (default)."),
    packing: Optional[bool] = typer.Option(None, "--packing/--no-packing", help="Padding-free packed batches (TRL padding_free / packing): the micro-batch in one row with restarting position ids, no padding; text-only."),
    empty_cache_steps: Optional[int] = typer.Option(None, "--empty-cache-steps", help="torch.cuda.empty_cache() every N steps where the loop calls it (Trainer: after the forward; custom: after the step); 0 = never (default)."),
    liger: Optional[bool] = typer.Option(None, "--liger/--no-liger", help="Liger kernels as use_liger_kernel=True applies them: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE (default off)."),
    chunked_ce: Optional[int] = typer.Option(None, "--chunked-ce", help="Chunked cross-entropy (torchtune): the logits in N chunks, each upcast to fp32 in the loss; 0 = off (default)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="llava-1.5-pretrain, llava-1.5-finetune, llava-1.5-finetune-lora (official LLaVA-1.5 scripts)."),
    deepspeed: Optional[str] = typer.Option(None, "--deepspeed", help="DeepSpeed config JSON ('auto' resolved as transformers does)."),
    training_args: Optional[str] = typer.Option(None, "--training-args", help="HF TrainingArguments fields as JSON."),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Data-parallel GPUs; memory is predicted per GPU."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="none, ddp, zero1, zero2, zero3, fsdp."),
    zero_stage: Optional[int] = typer.Option(None, "--zero-stage", help="DeepSpeed ZeRO stage 1, 2 or 3 (= --strategy zeroN)."),
    offload_optimizer: Optional[str] = typer.Option(None, "--offload-optimizer", help="none or cpu (ZeRO-Offload)."),
    offload_param: Optional[str] = typer.Option(None, "--offload-param", help="none or cpu (ZeRO-3 only)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU from the catalogue, e.g. h100-80gb, a100-40gb, h200."),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GPU memory in GiB (instead of --gpu)."),
    find_max_batch: bool = typer.Option(False, "--find-max-batch", help="Search the largest micro-batch that fits the GPU."),
    method: Optional[str] = typer.Option(None, "--method", help="analytic, trace or hybrid (default: hybrid when a GPU-calibrated model in models/ was trained on this torch, else analytic; trace for PEFT methods and model families only it can price)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Save a stacked bar chart (PNG/SVG/PDF) to FILE."),
    timeline: Optional[str] = typer.Option(None, "--timeline", help="(trace) Save the memory timeline as JSON or PNG."),
) -> None:
    """Predict the peak GPU memory of one training configuration."""
    from hybridmem.predict import predict
    from hybridmem.report import plot as save_plot, render

    from hybridmem.parallel.cli import fit_lines, spec_from_cli
    from hybridmem.parallel.fit import smallest_fitting_setup

    # recipe < --training-args < --deepspeed < explicit flags (None = flag not given)
    spec = spec_from_cli(model=model, recipe=recipe, deepspeed=deepspeed,
                         training_args=training_args, micro_batch=micro_batch, seq_len=seq_len,
                         images_per_sample=images_per_sample, image_size=image_size,
                         precision=precision, optimizer=optimizer, grad_ckpt=grad_ckpt,
                         grad_ckpt_policy=grad_ckpt_policy, train=train, lora_r=lora_r, lora_alpha=lora_alpha,
                         lora_targets=lora_targets, attn=attn, peft_config=peft_config,
                         quantize=quantize, quantization_config=quantization_config,
                         kbit_prep=kbit_prep, loop=loop, max_grad_norm=max_grad_norm, grad_accum=grad_accum,
                         empty_cache_steps=empty_cache_steps, liger=liger, chunked_ce=chunked_ce,
                         world_size=world_size, optimizer_in_backward=optimizer_in_backward,
                         offload_activations=offload_activations, packing=packing,
                         strategy=strategy, zero_stage=zero_stage,
                         offload_optimizer=offload_optimizer, offload_param=offload_param)
    target = resolve_gpu(gpu, gpu_mem)
    options = {}
    if timeline is not None:
        if resolve_method(method, spec) != "trace":
            raise SpecError("timeline", timeline, reason="--timeline needs --method trace")
        options["timeline"] = timeline
    given, method = method, resolve_method(method, spec)
    result = predict(spec, method=method, gpu=target, find_max_batch=find_max_batch, **options)
    result = _method_note(result, method, given, spec)
    advice = None
    if target is not None and (spec.parallel.strategy != "none" or not result.fits):
        advice = smallest_fitting_setup(spec, target, lambda s: predict(s, method=method, gpu=target))
    if plot:
        save_plot(result, plot)
    if as_json:
        out = result.to_dict()
        if advice is not None:
            out["fit"] = advice
        typer.echo(json.dumps(out, indent=2))
    else:
        render(result)
        if advice is not None:
            typer.echo("\n".join(fit_lines(advice)))


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_command)
