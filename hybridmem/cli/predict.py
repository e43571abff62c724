"""`hybridmem predict`: options -> TrainingSpec -> predict() -> table / JSON / plot.

Option names are a contract other tools script against (issue #2); keep them stable.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU, custom_gpu, gpu_by_name
from hybridmem.spec import LoraSpec, TrainingSpec


def build_spec(*, model: str, micro_batch: int, seq_len: int, images_per_sample: int | None,
               image_size: int | None, precision: str, optimizer: str, grad_ckpt: bool,
               train: str, lora_r: int | None, lora_alpha: float | None,
               lora_targets: str | None, attn: str) -> TrainingSpec:
    """A validated TrainingSpec from CLI values (LoRA flags need --train lora)."""
    lora_given = any(v is not None for v in (lora_r, lora_alpha, lora_targets))
    lora = None
    if train == "lora":
        defaults = LoraSpec()
        targets = (tuple(t.strip() for t in lora_targets.split(",") if t.strip())
                   if lora_targets is not None else defaults.targets)
        lora = LoraSpec(r=lora_r if lora_r is not None else defaults.r,
                        alpha=lora_alpha if lora_alpha is not None else defaults.alpha,
                        targets=targets)
    elif lora_given:
        raise SpecError("train", train, ["lora"], reason="--lora-* options need --train lora")
    return TrainingSpec(model=model, micro_batch=micro_batch, seq_len=seq_len,
                        images_per_sample=images_per_sample, image_size=image_size,
                        precision=precision, optimizer=optimizer, grad_ckpt=grad_ckpt,
                        train=train, lora=lora, attn=attn)


def resolve_gpu(gpu: str | None, gpu_mem: float | None) -> GPU | None:
    if gpu is not None and gpu_mem is not None:
        raise SpecError("gpu", gpu, reason="give --gpu or --gpu-mem, not both")
    if gpu is not None:
        return gpu_by_name(gpu)
    if gpu_mem is not None:
        return custom_gpu(gpu_mem)
    return None


def predict_command(
    model: str = typer.Option(..., "--model", help="Preset name or path to a HF config.json (or its folder)."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Samples per GPU per step."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per sample, image tokens included."),
    images_per_sample: Optional[int] = typer.Option(None, "--images-per-sample", help="Default: 1 for multimodal models, 0 for LLMs."),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="Image side in pixels; default: the vision tower's."),
    precision: str = typer.Option("bf16-mixed", "--precision", help="fp32, bf16, fp16, bf16-mixed, fp16-mixed, bf16-master."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, adamw-fused, adamw-8bit, sgd, sgd-momentum, adafactor, lion."),
    grad_ckpt: bool = typer.Option(False, "--grad-ckpt/--no-grad-ckpt", help="Gradient checkpointing."),
    train: str = typer.Option("full", "--train", help="full, llm+projector, projector, lora."),
    lora_r: Optional[int] = typer.Option(None, "--lora-r", help="LoRA rank (default 8)."),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help="LoRA alpha (default 16)."),
    lora_targets: Optional[str] = typer.Option(None, "--lora-targets", help="Comma-separated module names (default: all LLM linear layers)."),
    attn: str = typer.Option("sdpa", "--attn", help="eager, sdpa, flash_attention_2."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU from the catalogue, e.g. h100-80gb, a100-40gb, h200."),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GPU memory in GiB (instead of --gpu)."),
    find_max_batch: bool = typer.Option(False, "--find-max-batch", help="Search the largest micro-batch that fits the GPU."),
    method: str = typer.Option("analytic", "--method", help="analytic, trace or hybrid."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Save a stacked bar chart (PNG/SVG/PDF) to FILE."),
    timeline: Optional[str] = typer.Option(None, "--timeline", help="(trace) Save the memory timeline as JSON or PNG."),
) -> None:
    """Predict the peak GPU memory of one training configuration."""
    from hybridmem.predict import predict
    from hybridmem.report import plot as save_plot, render

    spec = build_spec(model=model, micro_batch=micro_batch, seq_len=seq_len,
                      images_per_sample=images_per_sample, image_size=image_size,
                      precision=precision, optimizer=optimizer, grad_ckpt=grad_ckpt, train=train,
                      lora_r=lora_r, lora_alpha=lora_alpha, lora_targets=lora_targets, attn=attn)
    target = resolve_gpu(gpu, gpu_mem)
    options = {}
    if timeline is not None:
        if method != "trace":
            raise SpecError("timeline", timeline, reason="--timeline needs --method trace")
        options["timeline"] = timeline
    result = predict(spec, method=method, gpu=target, find_max_batch=find_max_batch, **options)
    if plot:
        save_plot(result, plot)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        render(result)


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_command)
