"""Adapter: huggingface/peft's MetaMathQA benchmark results (method_comparison/MetaMathQA).

One record (a line of `/work/shared/data/published/peft-metamathqa.jsonl`, described in the
README next to it) is one training run of meta-llama/Llama-3.2-3B on one GPU. What the run
does, from the benchmark's run.py / utils.py / default_training_params.json:

- `AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`: pure bf16 weights, no autocast
  (precision `bf16`); attention implementation None -> SDPA; PEFT adapters in fp32
  (`autocast_adapter_dtype=True`, as our LoRA does).
- `torch.optim.AdamW(model.parameters(), **optimizer_kwargs)`: foreach on CUDA (`adamw`);
  `optimizer_type` "lora-fa": `peft.optimizers.create_lorafa_optimizer(model, r, lora_alpha,
  lr, weight_decay)` (`lora-fa`; its r / lora_alpha must be the adapter's).
- `outputs = model(**batch); loss = outputs.loss; loss.backward()`: the outputs (logits) live
  through backward (loop `custom`); `clip_grad_norm_(grad_norm_clip)`; no accumulation.
- samples truncated at `max_seq_length` and padded to the longest of each batch: the record's
  seq_len is an upper bound of a variable length (`seq_len_kind` "upper-bound").

The figure (`value`) is `torch.cuda.max_memory_reserved()` at the end of the run minus
`accelerator_memory_init`, the reserved bytes right after `init_accelerator()` (utils.py): that
function moves one `nn.Linear(1, 1)` to the device, i.e. two 4-byte tensors, each rounded up
to 512 bytes and served from the small pool, whose segments are `kSmallBuffer` = 2 MiB
(c10/cuda/CUDACachingAllocator.cpp: requests <= kSmallSize (1 MiB) get a 2 MiB segment). The
tensors die at once but the segment stays cached, and `reset_peak_memory_stats()` then sets
the peak to the current reserved bytes: `accelerator_memory_init` = 2 MiB. So
`value + 2 MiB` is exactly what `max_memory_reserved()` returned at the end of the run - the
same allocator statistic as our harness's `reserved_bytes.all.peak` - and that is what
`peak_reserved_bytes` holds; the figure as published stays in `published_value_bytes`. (The
2 MiB start-up segment is the benchmark's, not the job's; a fresh job of the same spec
reserves its own small-pool segments. The difference is at most 2 MiB, < 0.02 % here.)
The peak covers training and the evaluation `generate()` passes; no allocated peak and no
device (nvidia-smi) figure exist, so those targets are null.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from hybridmem.adapters import config_type, group_of, spec_fields
from hybridmem.errors import SpecError
from hybridmem.harness.schema import spec_hash
from hybridmem.job.spec import TrainingSpec

NAME = "peft-metamathqa"
VERSION = "1"

INIT_RESERVED_BYTES = 2 * 1024**2
"""Reserved bytes after `init_accelerator()`: one kSmallBuffer (2 MiB) small-pool segment."""

PRESETS: dict[str, str] = {"meta-llama/Llama-3.2-3B": "llama-3.2-3b"}
"""HF model id -> shipped preset; the record's `model_config` must match it field by field."""

# record model_config key -> preset config key (arch is the first entry of `architectures`)
SHAPE_KEYS: dict[str, str] = {
    "arch": "architectures", "head_dim": "head_dim", "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size", "num_attention_heads": "num_attention_heads",
    "num_hidden_layers": "num_hidden_layers", "num_key_value_heads": "num_key_value_heads",
    "tie_word_embeddings": "tie_word_embeddings", "vocab_size": "vocab_size",
}

OPTIMIZERS: dict[str, str] = {"AdamW": "adamw", "lora-fa": "lora-fa"}
"""The benchmark's `optimizer_type` (a torch.optim class name, or a peft optimizer factory)
-> spec optimizer."""
UNREPRESENTABLE_OPTIMIZERS: dict[str, str] = {
    "lora+": "optimizer 'lora+' (peft create_loraplus_optimizer) has no TrainingSpec optimizer",
    "riemannian": "optimizer 'riemannian' (peft create_riemannian_optimizer) has no "
                  "TrainingSpec optimizer",
}

# Keys of `extra_metrics` holding the mean memory_allocated() right after optimizer.step()
# (the benchmark renamed its keys over time; every name seen in the published file).
STEADY_ALLOCATED_KEYS: tuple[str, ...] = (
    "mem_allocated_avg_over_run (mean of per-250-step window averages)",
    "mem_allocated_avg_over_run",
)
SEQ_LEN_KIND = "upper-bound"
"""The record's seq_len is `max_seq_length`: batches are padded to their longest sample."""


@lru_cache(maxsize=8)
def _preset_text(hf_id: str) -> tuple[str, str]:
    from hybridmem.models.loader import load_config_dict

    label, cfg = load_config_dict(PRESETS[hf_id])
    return label, json.dumps({k: v for k, v in cfg.items() if not k.startswith("_")}, sort_keys=True)


@lru_cache(maxsize=8)
def _preset_params(hf_id: str) -> int:
    from hybridmem.models.build import build_graph

    return build_graph(TrainingSpec(model=PRESETS[hf_id], train="full")).num_params


def _preset(hf_id: str) -> tuple[str, dict]:
    label, text = _preset_text(hf_id)
    return label, json.loads(text)


def model_mismatch(record_cfg: dict) -> str:
    """Why the record's model is not the shipped preset ('' when every shape field is equal)."""
    hf_id = record_cfg.get("hf_id")
    if hf_id not in PRESETS:
        return f"model {hf_id!r} has no shipped preset"
    label, cfg = _preset(hf_id)
    for key, pkey in SHAPE_KEYS.items():
        want = cfg.get(pkey)
        want = want[0] if key == "arch" and isinstance(want, list) else want
        if record_cfg.get(key) != want:
            return f"model_config {key}={record_cfg.get(key)!r} differs from preset {label} ({want!r})"
    if "num_params" in record_cfg:
        n = _preset_params(hf_id)
        if record_cfg["num_params"] != n:
            return f"model_config num_params={record_cfg['num_params']} differs from preset {label} ({n})"
    return ""


def cuda_version(torch_version: str) -> str:
    """'12.6' from a torch version with a CUDA suffix ('2.7.1+cu126'); '' without one."""
    m = re.search(r"\+cu(\d+)(\d)$", torch_version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def group(adapter_config: dict | None) -> str:
    """Evaluation group (`adapters.GROUPS`): full, lora, dora or other-peft (from the config, so
    excluded records are grouped too)."""
    return group_of(config_type(adapter_config))


def steady_allocated(extra: dict) -> float | None:
    for key in STEADY_ALLOCATED_KEYS:
        if key in extra:
            return float(extra[key])
    return None


def _spec(rec: dict) -> tuple[TrainingSpec | None, str]:
    """(spec, '') or (None, why the record is not representable)."""
    if rec["world_size"] != 1:
        return None, f"world_size {rec['world_size']} (only single-GPU runs are imported)"
    if rec["weights_dtype"] != "bfloat16" or not str(rec["autocast"]).startswith("none"):
        return None, f"weights {rec['weights_dtype']} / autocast {rec['autocast']!r} is not pure bf16"
    if "sdpa" not in str(rec["attn_implementation"]):
        return None, f"attention {rec['attn_implementation']!r} is not sdpa"
    why = model_mismatch(rec["model_config"])
    if why:
        return None, why
    opt = rec["optimizer"]
    if opt not in OPTIMIZERS:
        return None, UNREPRESENTABLE_OPTIMIZERS.get(opt, f"optimizer {opt!r} has no TrainingSpec optimizer")
    label, _ = _preset(rec["model_config"]["hf_id"])
    try:
        train = spec_fields(rec["adapter_config"]) if rec["adapter_config"] is not None \
            else {"train": "full"}
        spec = TrainingSpec(
            model=label, micro_batch=rec["micro_batch_per_gpu"], seq_len=rec["seq_len"],
            images_per_sample=0, precision="bf16", optimizer=OPTIMIZERS[opt],
            grad_ckpt=bool(rec["gradient_checkpointing"]), attn="sdpa", loop="custom",
            max_grad_norm=float(rec["grad_norm_clip"]), grad_accum=rec["grad_accum"],
            # run.py's ACCELERATOR_EMPTY_CACHE_SCHEDULE at that commit (1 or 10), as recorded
            empty_cache_steps=_empty_cache_steps(rec), **train)
        if spec.train != "peft":  # the model-dependent checks collect applies (LoRA targets)
            from hybridmem.models.build import build_graph
            from hybridmem.models.loader import materialize_config

            build_graph(spec.with_(model=materialize_config(_preset_text(rec["model_config"]["hf_id"])[1])))
    except SpecError as err:
        return None, f"spec rejected: {err}"
    if spec.optimizer == "lora-fa":  # the factory's r / lora_alpha against the adapter's
        kw = rec.get("optimizer_kwargs") or {}
        if (kw.get("r"), kw.get("lora_alpha")) != (spec.lora.r, spec.lora.alpha):
            return None, (f"lora-fa r={kw.get('r')} / lora_alpha={kw.get('lora_alpha')} differ "
                          f"from the adapter's r={spec.lora.r} / alpha={spec.lora.alpha}")
    return spec, ""


def _empty_cache_steps(rec: dict) -> int:
    """The record's own `measurement_semantics.empty_cache_every_n_steps` (null = never)."""
    n = rec["measurement_semantics"].get("empty_cache_every_n_steps")
    return 0 if n is None else int(n)


def row(rec: dict) -> dict:
    """The dataset row of one record (columns outside the spec; `importer` adds the rest)."""
    spec, why = _spec(rec)
    try:
        gpu_memory = _gpu_memory(rec["gpu"])
    except SpecError as err:
        gpu_memory = 0
        if spec is not None:
            spec, why = None, f"GPU {rec['gpu']!r} is not in the catalogue ({err.reason})"
    adapter_cfg = rec["adapter_config"]
    extra = rec["extra_metrics"]
    paths = rec["source_path"] if isinstance(rec["source_path"], list) else [rec["source_path"]]
    tv = rec["torch_version"]
    out = {
        "measurement_id": rec["id"], "outcome": "excluded" if spec is None else "ok",
        "excluded_reason": why, "group": group(adapter_cfg), "experiment": rec["experiment_name"],
        "seq_len_kind": SEQ_LEN_KIND, "published_value_bytes": int(rec["value"]),
        "published_metric": rec["metric"], "steady_allocated_bytes": steady_allocated(extra),
        "empty_cache_every_n_steps": rec["measurement_semantics"]["empty_cache_every_n_steps"],
        "measured_at": rec["run_created_at"], "peft_version": rec["peft_version"],
        "source_repo": rec["source_repo"], "source_path": json.dumps(paths),
        "source_commit": rec["source_commit"], "source_url": rec["source_url"],
        "published_json": json.dumps({k: rec[k] for k in (
            "metric", "value", "unit", "quote", "measures", "extra_metrics",
            "extra_metrics_definition", "measurement_semantics", "flags", "grade", "in_scope",
            "training_mode", "optimizer", "optimizer_kwargs", "max_steps", "eval_batch_size",
            "generation_kwargs", "source_commits_all", "peft_commit_at_run",
            "bitsandbytes_version") if k in rec}, sort_keys=True),
        "gpu_name": rec["gpu"], "torch_version": tv, "cuda_version": cuda_version(tv),
        "transformers_version": rec["transformers_version"], "iterations": rec["max_steps"],
        # the reserved peak of the run, reconstructed exactly (module docstring)
        "peak_reserved_bytes": int(rec["value"]) + INIT_RESERVED_BYTES,
        "micro_batch": rec["micro_batch_per_gpu"], "seq_len": rec["seq_len"],
        "grad_ckpt": bool(rec["gradient_checkpointing"]), "attn": "sdpa",
        "precision": "bf16", "optimizer": OPTIMIZERS.get(rec["optimizer"], rec["optimizer"]),
        "model_type": "llama" if rec["model_config"].get("arch") == "LlamaForCausalLM" else "",
        # the benchmark's loop (run.py), as `_spec` sets it; also on excluded rows
        "loop": "custom", "max_grad_norm": float(rec["grad_norm_clip"] or 0.0),
        "grad_accum": rec["grad_accum"], "empty_cache_steps": _empty_cache_steps(rec),
    }
    out["gpu_memory_bytes"] = gpu_memory
    if spec is None:
        out.update(spec_json="", model_config=json.dumps(rec["model_config"], sort_keys=True),
                   model_name=str(rec["model_config"].get("hf_id", "")),
                   train=_train_kind(adapter_cfg), lora_r=0)
        return out
    label, cfg = _preset(rec["model_config"]["hf_id"])
    spec_dict = spec.to_dict()
    out.update(spec_hash=spec_hash(spec_dict, cfg), spec_json=json.dumps(spec_dict, sort_keys=True),
               model_config=json.dumps(cfg, sort_keys=True), model_name=label,
               model_type=cfg["model_type"], train=spec.train,
               lora_r=spec.lora.r if spec.lora else 0, optimizer=spec.optimizer)
    return out


def _train_kind(adapter_cfg: dict | None) -> str:
    """`train` of an excluded row: what its adapter config would map to."""
    if adapter_cfg is None:
        return "full"
    try:
        return spec_fields(adapter_cfg)["train"]
    except SpecError:
        return "peft"


def _gpu_memory(device_name: str) -> int:
    from hybridmem.gpus import gpu_by_device_name

    return gpu_by_device_name(device_name).memory_bytes
