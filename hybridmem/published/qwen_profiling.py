"""Adapter: the QwenLM/Qwen README's "Profiling of Memory and Speed" (Qwen-1.8B, Qwen-14B).

One record (a line of `/work/shared/data/published/qwen-profiling.jsonl`, described in the
README next to it) is one single-GPU LoRA fine-tuning of a Qwen(1) model on an A100-SXM4-80G
under PyTorch 2.0 / CUDA 11.8, as the Qwen README prints it. What the run does, from that
README and the `finetune.py` / `finetune/finetune_lora_single_gpu.sh` it describes:

- Qwen(1) is remote code (`QWenLMHeadModel`), which transformers has no class for. It is priced
  as the same shapes in transformers' `qwen2` class: the shipped proxy presets `qwen-1_8b` and
  `qwen-14b` (their `_source` says what they are; every shape field of the record's
  `model_config` is checked equal). Module names map as `QWEN1_MODULES`; the fused `c_attn`
  (q, k, v in one linear with bias) becomes qwen2's q/k/v_proj (bias too). One LoRA adapter on
  `c_attn` (A: r x h, B: 3h x r) becomes three (3 x (r x h + h x r)): the proxy counts 2 r h
  more adapter parameters per layer (r 64: 6.3 M for 1.8B, 26 M for 14B; with their fp32
  gradients and AdamW states about 0.1 and 0.4 GB, 1-2 % of the figures). Each row records the
  proxy in `published_json["priced_as"]`.
- micro-batch 1, gradient accumulation 8, gradient checkpointing, FlashAttention-2
  (`flash_attention_2`), HF `Trainer` (`loop = "trainer"`, `max_grad_norm` its default 1.0)
  with `bf16=True` on weights the remote code loads in bf16: precision `bf16` (bf16 weights;
  the LoRA adapters kept fp32, as our LoRA prices them); `adamw_torch` -> `adamw`.
- every sample padded to `model_max_length` = `seq_len` (`seq_len_kind` "exact").
- LoRA r 64, alpha 16, dropout 0.05 on c_attn, c_proj, w1, w2 (every linear but the head);
  "LoRA (emb)" rows also train the embedding and output layer (`modules_to_save` wte, lm_head).

The figure (`value`, "memory (GB)") is stored as `peak_device_bytes` = value x 10^9. Both halves
are assumptions the README next to the file states: which tool measured it is not published
(taken as the whole process on the GPU, CUDA context included: the device figure), nor
whether G is 10^9 or 2^30 (10^9, as the file's own `value_gib` column converts it; 2^30 would
make every figure 7.4 % larger). The figure as published stays in `published_value_bytes`
(x 10^9) and `published_json`. No allocated or reserved peak was published.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from hybridmem.adapters import config_type, group_of, spec_fields
from hybridmem.errors import SpecError
from hybridmem.harness.schema import spec_hash
from hybridmem.job.spec import TrainingSpec

NAME = "qwen-profiling"
VERSION = "1"

PRESETS: dict[str, str] = {"Qwen/Qwen-1_8B(-Chat)": "qwen-1_8b", "Qwen/Qwen-14B(-Chat)": "qwen-14b"}
"""The record's `model_id` -> shipped qwen2-class proxy preset (same tensor shapes)."""

SHAPE_KEYS: tuple[str, ...] = ("hidden_size", "intermediate_size", "num_attention_heads",
                               "num_hidden_layers", "num_key_value_heads", "tie_word_embeddings",
                               "vocab_size")
"""Fields of the record's `model_config` that must equal the proxy preset's (its
`intermediate_size` is already the per-half MLP size, as qwen2's)."""

QWEN1_MODULES: dict[str, tuple[str, ...]] = {
    "c_attn": ("q_proj", "k_proj", "v_proj"),  # fused q, k, v (with bias)
    "c_proj": ("o_proj", "down_proj"),  # attention output and MLP down projection share the name
    "w1": ("up_proj",),  # Qwen(1) MLP: c_proj(w1(x) * silu(w2(x)))
    "w2": ("gate_proj",),
    "wte": ("embed_tokens",),
    "lm_head": ("lm_head",),
}
"""Qwen(1) module names (remote-code `modeling_qwen.py`) -> the qwen2 class's."""

GPU_NAMES: dict[str, str] = {"A100-SXM4-80G": "NVIDIA A100-SXM4-80GB"}
"""The record's GPU -> the name `torch.cuda.get_device_name` gives that board (the catalogue's
key, `hybridmem.gpus.DEVICE_NAMES`)."""

BYTES_PER_GB = 10**9
"""The assumed unit of "memory (GB)" (module docstring)."""

SEQ_LEN_KIND = "exact"
"""finetune.py pads every sample to model_max_length: the record's seq_len is the length."""


@lru_cache(maxsize=4)
def _preset_text(label: str) -> str:
    from hybridmem.models.loader import load_config_dict

    _, cfg = load_config_dict(label)
    return json.dumps({k: v for k, v in cfg.items() if not k.startswith("_")}, sort_keys=True)


def _preset(label: str) -> dict:
    return json.loads(_preset_text(label))


def model_mismatch(rec: dict) -> str:
    """Why the record's model is not its proxy preset ('' when every shape field is equal)."""
    label = PRESETS.get(rec["model_id"])
    if label is None:
        return f"model {rec['model_id']!r} has no proxy preset"
    cfg, published = _preset(label), rec["model_config"]
    for key in SHAPE_KEYS:
        if published.get(key) != cfg.get(key):
            return (f"model_config {key}={published.get(key)!r} differs from proxy preset "
                    f"{label} ({cfg.get(key)!r})")
    return ""


def qwen2_modules(names) -> tuple[str, ...]:
    """Qwen(1) module names -> the qwen2 class's (a name outside `QWEN1_MODULES` is an error)."""
    out = []
    for name in names or ():
        if name not in QWEN1_MODULES:
            raise SpecError("adapter_config module", name, sorted(QWEN1_MODULES))
        out += QWEN1_MODULES[name]
    return tuple(dict.fromkeys(out))


def adapter_config(rec_cfg: dict) -> dict:
    """The record's PEFT config with Qwen(1) module names turned into the proxy's."""
    cfg = {k: v for k, v in rec_cfg.items() if k != "note"}
    cfg["target_modules"] = list(qwen2_modules(rec_cfg.get("target_modules")))
    if rec_cfg.get("modules_to_save"):
        cfg["modules_to_save"] = list(qwen2_modules(rec_cfg["modules_to_save"]))
    return cfg


def versions(text: str) -> tuple[str, str]:
    """('2.0', '11.8') from the record's "2.0 (CUDA 11.8)"; '' where absent."""
    m = re.match(r"\s*([\d.]+)\s*(?:\(CUDA\s*([\d.]+)\))?", text or "")
    return (m.group(1), m.group(2) or "") if m else ("", "")


def group(rec: dict) -> str:
    return group_of(config_type(rec.get("adapter_config")))


def _spec(rec: dict) -> tuple[TrainingSpec | None, str]:
    """(spec, '') or (None, why the record is not representable)."""
    if rec["world_size"] != 1:
        return None, f"world_size {rec['world_size']} (only single-GPU runs are imported)"
    if rec["micro_batch_per_gpu"] is None or rec["seq_len"] is None:
        return None, "micro-batch or sequence length not published"
    why = model_mismatch(rec)
    if why:
        return None, why
    if rec["adapter_config"] is None:
        return None, "no adapter config (only the LoRA rows are in this file)"
    label = PRESETS[rec["model_id"]]
    try:
        train = spec_fields(adapter_config(rec["adapter_config"]))
        spec = TrainingSpec(
            model=label, micro_batch=rec["micro_batch_per_gpu"], seq_len=rec["seq_len"],
            images_per_sample=0, precision="bf16", optimizer="adamw",
            grad_ckpt=bool(rec["gradient_checkpointing"]), attn="flash_attention_2",
            loop="trainer", max_grad_norm=1.0, grad_accum=rec["grad_accum"], **train)
        from hybridmem.models.build import build_graph  # LoRA targets exist in the proxy

        build_graph(spec)
    except SpecError as err:
        return None, f"spec rejected: {err}"
    return spec, ""


def row(rec: dict) -> dict:
    """The dataset row of one record (columns outside the spec; `importer` adds the rest)."""
    from hybridmem.gpus import gpu_by_device_name

    spec, why = _spec(rec)
    gpu = GPU_NAMES.get(rec["gpu"], rec["gpu"])
    try:
        gpu_memory = gpu_by_device_name(gpu).memory_bytes
    except SpecError as err:
        gpu_memory = 0
        if spec is not None:
            spec, why = None, f"GPU {rec['gpu']!r} is not in the catalogue ({err.reason})"
    torch_version, cuda = versions(rec["torch_version"])
    label = PRESETS.get(rec["model_id"], "")
    value = round(float(rec["value"]) * BYTES_PER_GB)
    priced_as = {"preset": label, "class": "Qwen2ForCausalLM (transformers qwen2)",
                 "modules": {k: list(v) for k, v in QWEN1_MODULES.items()},
                 "why": "Qwen(1) is remote code (QWenLMHeadModel); the proxy has the same "
                        "tensor shapes; its separate q/k/v_proj carry three LoRA adapters "
                        "where the fused c_attn carries one (2 r h more adapter parameters "
                        "per layer)",
                 "figure": "peak_device_bytes = value x 10^9 (tool and GB unit not published)"}
    quote = rec["quote"].split("|")
    out = {
        "measurement_id": rec["id"], "outcome": "excluded" if spec is None else "ok",
        "excluded_reason": why, "group": group(rec),
        "experiment": " | ".join(q.strip() for q in quote[:3]), "seq_len_kind": SEQ_LEN_KIND,
        "published_value_bytes": value, "published_metric": rec["metric"],
        "measured_at": "", "peft_version": "", "source_repo": rec["source_repo"],
        "source_path": json.dumps([rec["source_path"]]), "source_commit": rec["source_commit"],
        "source_url": rec["source_url"],
        "published_json": json.dumps({**{k: rec[k] for k in (
            "metric", "value", "unit", "value_gib", "quote", "measures", "flags", "grade",
            "in_scope", "training_mode", "optimizer", "autocast", "weights_dtype",
            "attn_implementation", "seq_len_kind", "model_config", "adapter_config",
            "torch_version", "parallelism") if k in rec}, "priced_as": priced_as},
            sort_keys=True),
        "gpu_name": gpu, "gpu_memory_bytes": gpu_memory, "torch_version": torch_version,
        "cuda_version": cuda, "transformers_version": rec.get("transformers_version") or "",
        "iterations": 0,  # not published
        "peak_device_bytes": value, "device_source": "published",
        "micro_batch": rec["micro_batch_per_gpu"], "seq_len": rec["seq_len"],
        "grad_ckpt": bool(rec["gradient_checkpointing"]), "attn": "flash_attention_2",
        "precision": "bf16", "optimizer": "adamw", "model_type": "qwen2", "loop": "trainer",
        "max_grad_norm": 1.0, "grad_accum": rec["grad_accum"], "empty_cache_steps": 0,
    }
    if spec is None:
        out.update(spec_json="", model_config=json.dumps(rec["model_config"], sort_keys=True),
                   model_name=str(rec["model_id"]), train="lora", lora_r=0)
        return out
    cfg = _preset(label)
    spec_dict = spec.to_dict()
    out.update(spec_hash=spec_hash(spec_dict, cfg), spec_json=json.dumps(spec_dict, sort_keys=True),
               model_config=json.dumps(cfg, sort_keys=True), model_name=label, train=spec.train,
               lora_r=spec.lora.r if spec.lora else 0)
    return out
