"""The official LLaVA-1.5 training recipes as data, in the form users already have them.

Each recipe is the pair (HF TrainingArguments fields, DeepSpeed JSON) of haotian-liu/LLaVA
`scripts/v1_5/{pretrain,finetune,finetune_lora}.sh` and `scripts/zero{2,3}.json`, so that it goes
through exactly the same parsing (and "auto" resolution) as a user's own files.

- pretrain: only the projector trains (`--tune_mm_mlp_adapter True`), ZeRO-2, batch 32/GPU.
- finetune: LLM + projector, vision tower frozen, ZeRO-3, batch 16/GPU.
- finetune-lora: LoRA r=128, alpha=256 on the LLM's linear layers, ZeRO-3, batch 16/GPU.
All: bf16, gradient checkpointing, `model_max_length 2048`, FlashAttention-2 (`train_mem.py`),
8 GPUs (the README's 8x A100 setup: global batch 256 for pretraining, 128 for finetuning).
The optimizer is HF's default of the pinned transformers 4.37.2, `adamw_torch` (LLaVA
pyproject.toml), wrapped by ZeRO since the DeepSpeed JSONs have no "optimizer" block.
"""

from __future__ import annotations

# The two DeepSpeed files are transcribed whole, key for key, although they share the fp16/bf16/
# batch block (upstream repeats it too): each stays checkable line by line against its source.

# scripts/zero2.json (LLaVA repository)
ZERO2_JSON: dict = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "reduce_bucket_size": "auto"},
}

# scripts/zero3.json (LLaVA repository)
ZERO3_JSON: dict = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
}

_COMMON_ARGS: dict = {
    "bf16": True, "gradient_checkpointing": True, "model_max_length": 2048,
    "gradient_accumulation_steps": 1, "optim": "adamw_torch",
    "attn_implementation": "flash_attention_2", "world_size": 8,
}

RECIPES: dict[str, dict] = {
    "llava-1.5-pretrain": {
        "training_args": {**_COMMON_ARGS, "per_device_train_batch_size": 32,
                          "tune_mm_mlp_adapter": True},
        "deepspeed": ZERO2_JSON,
    },
    "llava-1.5-finetune": {
        "training_args": {**_COMMON_ARGS, "per_device_train_batch_size": 16},
        "deepspeed": ZERO3_JSON,
        # LLaVA train.py never unfreezes the vision tower: LLM + projector train
        "spec": {"train": "llm+projector"},
    },
    "llava-1.5-finetune-lora": {
        "training_args": {**_COMMON_ARGS, "per_device_train_batch_size": 16,
                          "lora_enable": True, "lora_r": 128, "lora_alpha": 256},
        "deepspeed": ZERO3_JSON,
    },
}
"""Recipe name -> {"training_args": HF TrainingArguments fields, "deepspeed": DeepSpeed JSON,
optionally "spec": TrainingSpec fields the two files cannot express}."""
