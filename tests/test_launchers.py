"""`--config FILE`: launchers' own YAML read as each launcher reads it (hybridmem/parallel/
launchers/), hub ids, and where each field of the job came from.

Each config below is a launcher's published example, transcribed (the source named above it);
where the example names a checkpoint without a preset here, its model line is swapped for a
hub id that has one (said beside it). The expected job is a hand reading of the launcher's
source, commented per field, and the same job given as flags must be the same spec.
"""

from __future__ import annotations

import json

import pytest

from hybridmem.cli import main
from hybridmem.errors import SpecError
from hybridmem.job.spec import DEFAULT_LORA_TARGETS
from hybridmem.models import hub
from hybridmem.models.loader import load_config_dict, preset_names
from hybridmem.intake.config_keys import collect_warnings
from hybridmem.intake.merge import resolve_inputs, spec_from_inputs
from hybridmem.intake.resolve import resolve
from hybridmem.intake.dialects import detect, read_config

# hiyouga/LLaMA-Factory examples/train_lora/llama3_lora_sft.yaml (model: its
# meta-llama/Meta-Llama-3-8B-Instruct has no preset here)
LF_LORA = """\
### model
model_name_or_path: meta-llama/Llama-3.2-3B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
"""

# hiyouga/LLaMA-Factory examples/train_qlora/llama3_lora_sft_otfq.yaml (model swapped as above)
LF_QLORA = """\
model_name_or_path: meta-llama/Llama-3.2-3B-Instruct
quantization_bit: 4
quantization_method: bitsandbytes  # choices: [bitsandbytes (4/8), hqq (2/3/4/5/6/8), eetq (8)]
stage: sft
do_train: true
finetuning_type: lora
lora_target: all
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
val_size: 0.1
per_device_eval_batch_size: 1
eval_strategy: steps
eval_steps: 500
"""

# axolotl-ai-cloud/axolotl examples/llama-3/qlora.yml (base_model: its
# NousResearch/Meta-Llama-3-8B has no preset here)
AXOLOTL_QLORA = """\
base_model: meta-llama/Llama-3.2-3B
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer

load_in_8bit: false
load_in_4bit: true
strict: false

datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
dataset_prepared_path:
val_set_size: 0
output_dir: ./outputs/qlora-out

adapter: qlora
lora_model_dir:

sequence_len: 4096
sample_packing: true
pad_to_sequence_len: true

lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules:
lora_target_linear: true
lora_fan_in_fan_out:

wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:

gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 4
optimizer: paged_adamw_32bit
lr_scheduler: cosine
learning_rate: 0.0002

train_on_inputs: false
group_by_length: false
bf16: auto
fp16:
tf32: false

gradient_checkpointing: true
early_stopping_patience:
resume_from_checkpoint:
local_rank:
logging_steps: 1
xformers_attention:
flash_attention: true

warmup_steps: 10
evals_per_epoch: 4
eval_table_size:
saves_per_epoch: 1
debug:
deepspeed:
weight_decay: 0.0
fsdp:
fsdp_config:
special_tokens:
  pad_token: "<|end_of_text|>"
"""

# axolotl-ai-cloud/axolotl examples/llama-3/fft-1b-fsdp.yml (base_model: its
# meta-llama/Llama-3.2-1B has no preset here): FSDP1 options, `fsdp_`-prefixed keys
AXOLOTL_FSDP1 = """\
base_model: meta-llama/Llama-3.2-3B
save_safetensors: true
datasets:
  - path: teknium/GPT4-LLM-Cleaned
    type: alpaca
dataset_prepared_path: ./last_run_prepared
output_dir: ./outputs/fft-out
sequence_len: 2048
gradient_accumulation_steps: 1
micro_batch_size: 1
num_epochs: 1
optimizer: adamw_torch
learning_rate: 2e-5
bf16: auto
fp16:
tf32: false
logging_steps: 10
xformers_attention:
flash_attention: true
warmup_steps: 10
evals_per_epoch: 2
save_steps: 2
max_steps: 5
weight_decay: 0.0
fsdp:
  - full_shard
  - auto_wrap
fsdp_config:
  fsdp_limit_all_gathers: true
  fsdp_sync_module_states: true
  fsdp_offload_params: false
  fsdp_use_orig_params: true
  fsdp_cpu_ram_efficient_loading: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_backward_prefetch: BACKWARD_PRE
"""

# the FSDP2 form of axolotl's examples (examples/llama-3/3b-qat-fsdp2.yaml: top-level
# fsdp_version, unprefixed fsdp_config keys), with a mixed-precision policy (fsdp.py FSDPConfig)
AXOLOTL_FSDP2 = """\
base_model: meta-llama/Llama-3.2-3B
datasets:
  - path: yahma/alpaca-cleaned
    type: alpaca
output_dir: ./outputs/out/
sequence_len: 8192
gradient_accumulation_steps: 1
micro_batch_size: 4
optimizer: adamw_torch_fused
learning_rate: 2e-5
bf16: true
fsdp_version: 2
fsdp_config:
  offload_params: false
  cpu_ram_efficient_loading: false
  auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: LlamaDecoderLayer
  state_dict_type: FULL_STATE_DICT
  reshard_after_forward: false
  activation_checkpointing: true
  mixed_precision_policy: bf16
"""

# pytorch/torchtune recipes/configs/llama3_2/3B_lora_single_device.yaml (comments trimmed)
TORCHTUNE_LORA = """\
output_dir: /tmp/torchtune/llama3_2_3B/lora_single_device
model:
  _component_: torchtune.models.llama3_2.lora_llama3_2_3b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  lora_rank: 64
  lora_alpha: 128
  lora_dropout: 0.0
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /tmp/Llama-3.2-3B-Instruct/original/tokenizer.model
  max_seq_len: null
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: /tmp/Llama-3.2-3B-Instruct/
  checkpoint_files: [model-00001-of-00002.safetensors, model-00002-of-00002.safetensors]
  recipe_checkpoint: null
  output_dir: ${output_dir}
  model_type: LLAMA3_2
resume_from_checkpoint: False
save_adapter_weights_only: False
save_last_epoch_only: False
dataset:
  _component_: torchtune.datasets.alpaca_cleaned_dataset
  packed: False
seed: null
shuffle: True
batch_size: 4
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 3e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 100
loss:
  _component_: torchtune.modules.loss.LinearCrossEntropyLoss
epochs: 1
max_steps_per_epoch: null
gradient_accumulation_steps: 8
clip_grad_norm: null
compile: False
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${output_dir}/logs
log_every_n_steps: 1
log_peak_memory_stats: True
log_level: INFO
device: cuda
dtype: bf16
enable_activation_checkpointing: True
enable_activation_offloading: False
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: False
  output_dir: ${output_dir}/profiling_outputs
  cpu: True
  cuda: True
  profile_memory: False
  with_stack: False
  record_shapes: True
  with_flops: False
  wait_steps: 5
  warmup_steps: 3
  active_steps: 2
  num_cycles: 1
"""


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _read(tmp_path, name: str, text: str, **overrides):
    """(spec, sources, warnings) of a config file, `overrides` as flags on top."""
    path = _write(tmp_path, name, text)
    with collect_warnings() as caught:
        resolved = resolve(config=path, overrides=overrides)
    return resolved.spec, resolved.sources, list(caught), path


# ---------------------------------------------------------------- LLaMA-Factory

def test_llamafactory_lora_sft_is_the_job_its_source_says(tmp_path):
    spec, sources, warned, path = _read(tmp_path, "llama3_lora_sft.yaml", LF_LORA)
    flags = spec_from_inputs(overrides=dict(
        model="llama-3.2-3b",      # hub.py: meta-llama/Llama-3.2-3B-Instruct's shape = the preset
        train="lora",              # finetuning_type: lora
        lora_r=8, lora_alpha=16.0,  # lora_rank 8; lora_alpha None -> lora_rank * 2
        lora_targets=",".join(DEFAULT_LORA_TARGETS),  # lora_target all: every LLM linear
        micro_batch=1, grad_accum=8,  # per_device_train_batch_size, gradient_accumulation_steps
        seq_len=2048,              # cutoff_len, no packing for stage sft
        precision="bf16-autocast",  # bf16: the base loaded in bf16, LoRA upcast to fp32, and
                                    # Trainer's bf16 autocast (parser.py compute_dtype)
        grad_ckpt=True,            # disable_gradient_checkpointing defaults to False
        max_grad_norm=1.0,         # TrainingArguments' default, Trainer clips
        loop="trainer"))           # a transformers Trainer: only the loss outlives forward
    assert spec == flags
    assert spec.kbit_prep is True and spec.quantize == "none"  # nothing quantised
    assert warned == []  # warmup_ratio: a transformers 4.x TrainingArguments field
    assert sources["grad_accum"] == f"{path}: gradient_accumulation_steps"
    assert "seq_len" not in sources  # cutoff_len 2048 is the schema's default too
    assert sources["grad_ckpt"] == "launcher default (LLaMA-Factory)"
    assert sources["model"] == f"{path}: model_name_or_path (meta-llama/Llama-3.2-3B-Instruct)"
    assert "micro_batch" not in sources  # 1 is the schema default: no source recorded


def test_llamafactory_qlora_is_bitsandbytes_as_it_builds_it(tmp_path):
    spec, sources, warned, path = _read(tmp_path, "otfq.yaml", LF_QLORA)
    # quantization.py configure_quantization: BitsAndBytesConfig(load_in_4bit=True,
    # compute dtype = storage dtype = the compute dtype (bf16), double_quantization True,
    # quantization_type nf4); no prepare_model_for_kbit_training
    bnb = tmp_path / "bnb.json"
    bnb.write_text(json.dumps({"load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16",
                               "bnb_4bit_quant_storage": "bfloat16",
                               "bnb_4bit_use_double_quant": True,
                               "bnb_4bit_quant_type": "nf4"}))
    flags = spec_from_inputs(overrides=dict(
        model="llama-3.2-3b", train="lora", lora_r=8, lora_alpha=16.0, micro_batch=1,
        grad_accum=8, seq_len=2048, precision="bf16-autocast",  # bf16: Trainer's autocast too
        grad_ckpt=True, max_grad_norm=1.0, quantization_config=str(bnb), kbit_prep=False))
    assert spec == flags
    assert (spec.quantize, spec.quant_storage, spec.kbit_prep) == ("nf4", "bfloat16", False)
    assert warned == []
    assert sources["quantize"] == f"{path}: quantization_bit"


def test_llamafactory_defaults_fill_a_bare_file(tmp_path):
    spec, sources, _, path = _read(tmp_path, "bare.yaml",
                                   "model_name_or_path: Qwen/Qwen3-0.6B\nstage: pt\n")
    # finetuning_type lora, TrainingArguments' batch 8, packing on for stage pt (cutoff_len 2048
    # - 1), no bf16: the checkpoint's torch_dtype (bfloat16) loads the base; checkpointing on
    assert (spec.train, spec.micro_batch, spec.seq_len, spec.precision, spec.grad_ckpt) == (
        "lora", 8, 2047, "bf16", True)
    assert sources["micro_batch"] == "launcher default (LLaMA-Factory)"
    assert sources["precision"].startswith("launcher default (LLaMA-Factory) (the model's")


def test_llamafactory_full_vlm_freezes_the_tower_by_default(tmp_path):
    text = "model_name_or_path: llava-hf/llava-1.5-7b-hf\nfinetuning_type: full\nbf16: true\n"
    spec, *_ = _read(tmp_path, "full.yaml", text)
    # adapter.py _setup_full_tuning: freeze_vision_tower and freeze_multi_modal_projector
    # (finetuning_args.py, both default True) -> the LLM alone trains; trainable weights
    # upcast to fp32 under Trainer's bf16 autocast
    assert (spec.train, spec.precision) == ("llm", "bf16-mixed")
    spec, *_ = _read(tmp_path, "full1.yaml", text + "freeze_multi_modal_projector: false\n")
    assert spec.train == "llm+projector"
    both = "freeze_vision_tower: false\nfreeze_multi_modal_projector: false\n"
    spec, _, warned, _ = _read(tmp_path, "full2.yaml", text + both)
    assert spec.train == "full" and not warned
    # a trained tower under a frozen projector: priced as full, the projector's part warned
    spec, _, warned, _ = _read(tmp_path, "full3.yaml", text + "freeze_vision_tower: false\n")
    assert spec.train == "full" and any("freeze_multi_modal_projector" in w for w in warned)


def test_llamafactory_deepspeed_path_beside_the_file(tmp_path, monkeypatch):
    # LLaMA-Factory examples/deepspeed/ds_z3_config.json, named relative to the working
    # directory the launcher runs in; here found beside the YAML
    (tmp_path / "ds_z3_config.json").write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                              "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9,
                              "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True}}))
    monkeypatch.chdir(tmp_path.parent)
    spec, sources, warned, path = _read(tmp_path, "ds3.yaml",
                                        LF_LORA + "deepspeed: ds_z3_config.json\n", world_size=4)
    assert (spec.parallel.strategy, spec.micro_batch) == ("zero3", 1)  # "auto" <- the YAML's
    # ZeRO holds the bf16 base with fp32 master copies of what trains
    assert spec.precision == "bf16-master" and warned == []
    assert sources["strategy"] == f"{tmp_path / 'ds_z3_config.json'}: zero_optimization.stage"


# ---------------------------------------------------------------- axolotl

def test_axolotl_qlora_is_the_job_its_source_says(tmp_path):
    spec, sources, warned, path = _read(tmp_path, "qlora.yml", AXOLOTL_QLORA)
    # loaders/model.py _set_quantization_config: qlora + load_in_4bit -> nf4, double quant,
    # compute dtype torch_dtype (bf16: auto), storage bfloat16; the fp32 upcast of
    # prepare_model_for_kbit_training is undone for an adapter (_convert_embedding_modules_dtype)
    bnb = tmp_path / "bnb.json"
    bnb.write_text(json.dumps({"load_in_4bit": True, "llm_int8_threshold": 6.0,
                               "bnb_4bit_compute_dtype": "bfloat16",
                               "bnb_4bit_use_double_quant": True, "bnb_4bit_quant_type": "nf4",
                               "bnb_4bit_quant_storage": "bfloat16"}))
    flags = spec_from_inputs(overrides=dict(
        model="llama-3.2-3b", train="lora",
        lora_r=32, lora_alpha=16, lora_dropout=0.05,  # lora_r / lora_alpha / lora_dropout
        lora_targets=",".join(DEFAULT_LORA_TARGETS),  # lora_target_linear: all but lm_head
        micro_batch=2, grad_accum=4,  # micro_batch_size, gradient_accumulation_steps
        seq_len=4096,               # sequence_len (sample_packing fills rows of it)
        packing=True,               # sample_packing: the samples packed per row (techniques.packing)
        precision="bf16-autocast",  # bf16 auto -> torch_dtype bf16 base, PEFT's fp32 adapters,
                                    # Trainer bf16=True (builders/base.py)
        optimizer="paged-adamw",    # optimizer paged_adamw_32bit
        grad_ckpt=True, attn="flash_attention_2",  # gradient_checkpointing, flash_attention
        max_grad_norm=1.0,          # unset: TrainingArguments' 1.0
        quantization_config=str(bnb), kbit_prep=False))
    assert spec == flags
    assert warned == []  # every key is axolotl's, the empty ones too
    assert sources["optimizer"] == f"{path}: optimizer"
    assert sources["seq_len"] == f"{path}: sequence_len"


@pytest.mark.parametrize("bf16, precision", [
    ("auto", "bf16-autocast"),  # Trainer bf16=True over the bf16-loaded model
    ("true", "bf16-autocast"),
    ("false", "fp32"),          # torch_dtype float32, no autocast
])
def test_axolotl_bf16_is_trainer_autocast_unless_full(tmp_path, bf16, precision):
    text = AXOLOTL_QLORA.replace("bf16: auto", f"bf16: {bf16}")
    spec, sources, _, path = _read(tmp_path, "qlora.yml", text)
    assert spec.precision == precision
    assert sources["precision"].startswith(f"{path}: bf16")


def test_axolotl_fsdp1_prefixed_keys(tmp_path):
    spec, sources, warned, path = _read(tmp_path, "fft-fsdp.yml", AXOLOTL_FSDP1, world_size=8)
    flags = spec_from_inputs(overrides=dict(
        model="llama-3.2-3b", train="full",  # no adapter: full fine-tuning
        precision="bf16",          # bf16 auto: loaded and trained in bf16
        micro_batch=1, grad_accum=1, seq_len=2048, optimizer="adamw",  # adamw_torch: foreach
        attn="flash_attention_2", max_grad_norm=1.0,
        world_size=8, strategy="fsdp",  # fsdp: [full_shard, auto_wrap]
        reshard_after_forward=True,  # fsdp_sharding_strategy FULL_SHARD
        max_steps=5))  # max_steps (the steps a --lengths run prices)
    assert spec == flags
    assert warned == []  # fsdp_* keys are fsdp_config's, prefix stripped
    assert sources["strategy"] == f"{path}: fsdp_config.fsdp_sharding_strategy"


def test_axolotl_fsdp2_mixed_precision_policy(tmp_path):
    spec, sources, warned, path = _read(tmp_path, "fsdp2.yaml", AXOLOTL_FSDP2, world_size=4)
    p = spec.parallel
    assert (p.strategy, p.world_size, p.reshard_after_forward) == ("fsdp", 4, False)
    # fsdp.py mixed_precision_policy bf16: accelerate builds param_dtype = reduce_dtype = bf16
    assert (p.mp_param_dtype, p.mp_reduce_dtype) == ("bf16", "bf16")
    assert spec.grad_ckpt is True  # fsdp_config.activation_checkpointing
    assert (spec.micro_batch, spec.seq_len, spec.optimizer) == (4, 8192, "adamw-fused")
    assert sources["mp_param_dtype"] == f"{path}: fsdp_config.mixed_precision_policy"
    assert warned == []


def test_axolotl_fsdp_offload_is_refused(tmp_path):
    text = AXOLOTL_FSDP1.replace("fsdp_offload_params: false", "fsdp_offload_params: true")
    with pytest.raises(SpecError, match="offload_params.*not modelled"):
        _read(tmp_path, "off.yml", text, world_size=8)


# ---------------------------------------------------------------- torchtune

def test_torchtune_lora_single_device_is_the_job_its_recipe_says(tmp_path):
    spec, sources, warned, path = _read(tmp_path, "3B_lora_single_device.yaml", TORCHTUNE_LORA)
    flags = spec_from_inputs(overrides=dict(
        model="llama-3.2-3b",      # lora_llama3_2_3b builds Llama-3.2-3B
        train="lora", lora_r=64, lora_alpha=128,
        # q_proj, v_proj, output_proj (= o_proj) + apply_lora_to_mlp (w1, w3, w2)
        lora_targets="q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        micro_batch=4, grad_accum=8,  # batch_size, gradient_accumulation_steps
        precision="bf16",          # dtype: bf16 everywhere
        # LoRALinear's lora_a / lora_b are nn.Linear built under the recipe's default dtype
        adapter_dtype="bf16",
        optimizer="adamw-fused",   # torch.optim.AdamW with fused: True
        chunked_ce=8,              # LinearCrossEntropyLoss: num_output_chunks 8
        grad_ckpt=True,            # enable_activation_checkpointing
        max_grad_norm=0.0))        # clip_grad_norm: null
    assert spec == flags and spec.seq_len == 2048  # max_seq_len null: the schema's, warned
    text = "\n".join(warned)
    assert "tokenizer.max_seq_len" in text and "LinearCrossEntropyLoss" in text
    assert "model dtype" not in text  # adapters priced in bf16, as torchtune builds them
    assert sources["adapter_dtype"].startswith(f"{path}: dtype")
    assert sources["lora_targets"] == f"{path}: model.lora_attn_modules/model.apply_lora_to_mlp"


def test_torchtune_qlora_and_distributed_fsdp(tmp_path):
    text = TORCHTUNE_LORA.replace("lora_llama3_2_3b", "qlora_llama3_2_3b").replace(
        "max_seq_len: null", "max_seq_len: 1024")
    spec, sources, *_ = _read(tmp_path, "qlora.yaml", text)
    # qlora_ builders: quantize_base=True, torchao NF4 (block 64, double-quantised scalers)
    assert (spec.quantize, spec.quant_double_quant, spec.kbit_prep, spec.seq_len) == (
        "nf4", True, False, 1024)
    # half adapters over a quantised base are not priced: PEFT's fp32 ones, warned
    assert spec.adapter_dtype == "fp32" and any("model dtype" in w for w in _read(
        tmp_path, "qlora2.yaml", text)[2])
    # on several GPUs a _distributed recipe: FSDP2, never DDP; its reshard key is read
    spec, *_ = _read(tmp_path, "dist.yaml", TORCHTUNE_LORA, world_size=2)
    assert (spec.parallel.strategy, spec.parallel.reshard_after_forward) == ("fsdp", True)
    text = TORCHTUNE_LORA + "fsdp_reshard_after_forward: False\n"
    spec, *_ = _read(tmp_path, "dist2.yaml", text, world_size=2)
    assert (spec.parallel.strategy, spec.parallel.reshard_after_forward) == ("fsdp", False)


# ---------------------------------------------------------------- keys, dialects, errors

def test_a_misspelled_key_warns_with_the_nearest_and_the_launcher_default_stands(tmp_path):
    text = LF_LORA.replace("per_device_train_batch_size: 1", "per_device_train_batch_sise: 1")
    spec, sources, warned, path = _read(tmp_path, "typo.yaml", text)
    assert len(warned) == 1
    assert "'per_device_train_batch_sise'" in warned[0] and path in warned[0]
    assert "nearest known key: per_device_train_batch_size" in warned[0]
    # the key was dropped, so TrainingArguments' default batch is priced, and says so
    assert spec.micro_batch == 8 and sources["micro_batch"] == "launcher default (LLaMA-Factory)"
    for name, text in (("a.yml", AXOLOTL_QLORA.replace("sequence_len", "sequense_len")),
                       ("t.yaml", TORCHTUNE_LORA.replace("  lora_rank: 64", "  lora_rnak: 64"))):
        *_, warned, _ = _read(tmp_path, name, text)
        assert any("sequense_len" in w and "nearest known key: sequence_len" in w
                   or "model.lora_rnak" in w and "model.lora_rank" in w for w in warned), warned


def test_dialect_detected_or_forced(tmp_path):
    assert detect({"model_name_or_path": "x", "finetuning_type": "lora"}, "f") == "llamafactory"
    assert detect({"base_model": "x", "sequence_len": 8}, "f") == "axolotl"
    assert detect({"model": {"_component_": "torchtune.models.llama3_2.llama3_2_3b"}},
                  "f") == "torchtune"
    with pytest.raises(SpecError, match="--config-format"):
        detect({"model_name_or_path": "x", "learning_rate": 1e-5}, "f")
    # forced: a file with no LLaMA-Factory marker read as LLaMA-Factory
    path = _write(tmp_path, "plain.yaml", "model_name_or_path: Qwen/Qwen3-0.6B\nbf16: true\n")
    assert read_config(path, "llamafactory").model == "qwen3-0.6b"
    with pytest.raises(SpecError, match="config_format='mlx'"):
        read_config(path, "mlx")


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_malformed_yaml_and_unknown_hub_id_exit_2_in_one_line(tmp_path, capsys):
    bad = _write(tmp_path, "bad.yaml", "model_name_or_path: [unclosed\nbf16: true\n")
    code, out, err = _run(["predict", "--config", bad], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert bad in err and "malformed YAML at line" in err
    code, _, err = _run(["predict", "--model", "meta-llama/Llama-9-1T"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown hub id" in err and "local config.json" in err
    unknown = _write(tmp_path, "u.yml", AXOLOTL_QLORA.replace("meta-llama/Llama-3.2-3B",
                                                              "someone/NoSuchModel-7B"))
    code, _, err = _run(["predict", "--config", unknown], capsys)
    assert code == 2 and "someone/NoSuchModel-7B" in err and "unknown hub id" in err


def test_json_job_carries_sources_and_the_echo_names_them(tmp_path, capsys, stub_tier):
    path = _write(tmp_path, "train.yaml", LF_LORA)
    code, out, _ = _run(["predict", "--config", path, "--micro-batch", "4", "--method",
                         "analytic", "--json"], capsys)
    assert code == 0
    job = json.loads(out)["job"]
    assert job["sources"]["micro_batch"] == "flag --micro-batch"
    assert job["sources"]["grad_accum"] == f"{path}: gradient_accumulation_steps"
    assert job["model"] == "llama-3.2-3b" and job["warnings"] == []
    code, out, _ = _run(["predict", "--config", path, "--micro-batch", "4", "--method",
                         "analytic"], capsys)
    lines = out.splitlines()
    assert lines[0].startswith("model: llama-3.2-3b (train.yaml: model_name_or_path")
    assert "micro_batch=4 (flag --micro-batch)" in lines[1]
    assert "grad_accum=8 (train.yaml: gradient_accumulation_steps)" in lines[1]
    assert any("grad_ckpt=on (LLaMA-Factory default)" in line for line in lines[:7])


def test_flags_alone_echo_no_sources_and_defaults_record_none():
    resolved = resolve_inputs(overrides={"model": "tiny-llama", "micro_batch": 1,
                                         "grad_accum": 2})
    # a flag equal to the schema default changes nothing: only non-defaults have a source
    assert resolved.sources == {"model": "flag --model", "grad_accum": "flag --grad-accum"}


def test_training_args_fsdp_config_is_read(tmp_path):
    args = {"fsdp": "full_shard auto_wrap", "bf16": True, "world_size": 2,
            "fsdp_config": {"fsdp_reshard_after_forward": False,
                            "activation_checkpointing": True}}
    resolved = resolve_inputs(training_args=args, overrides={"model": "tiny-llama"})
    p = resolved.spec.parallel
    assert (p.strategy, p.reshard_after_forward, resolved.spec.grad_ckpt) == ("fsdp", False, True)
    assert resolved.sources["reshard_after_forward"] == \
        "training_args: fsdp_config.fsdp_reshard_after_forward"


# ---------------------------------------------------------------- hub ids

def test_every_hub_id_names_an_existing_preset_and_ignores_case():
    presets = set(preset_names())
    assert set(hub.HUB_PRESETS.values()) <= presets
    for hub_id, preset in hub.HUB_PRESETS.items():
        assert hub.resolve(hub_id.lower()) == preset == hub.resolve(hub_id.upper())
    # every preset transcribed from a published checkpoint has its hub id; one written out from
    # a transformers config class's defaults says so in its `_source` and maps no hub id
    real = {p for p in presets if not p.startswith("tiny-")
            and "Config() defaults" not in str(load_config_dict(p)[1].get("_source", ""))}
    assert real <= set(hub.HUB_PRESETS.values()), real - set(hub.HUB_PRESETS.values())


def test_a_hub_id_is_a_model_name_everywhere_and_a_local_folder_wins(tmp_path, monkeypatch):
    spec = spec_from_inputs(overrides={"model": "Qwen/Qwen3-0.6B"})
    assert spec.model == "qwen3-0.6b"
    assert hub.resolve("tiny-llama") == "tiny-llama"  # presets and paths pass through
    folder = tmp_path / "Qwen" / "Qwen3-0.6B"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a local folder of that name


def test_axolotl_cut_cross_entropy_plugin(tmp_path):
    # integrations/cut_cross_entropy/args.py: `cut_cross_entropy` defaults to True once the
    # CutCrossEntropyPlugin is listed; `false` turns it off; without the plugin nothing is patched
    plugin = "plugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n"
    text = AXOLOTL_QLORA.replace("load_in_4bit: true\n", "")
    text = text.replace("adapter: qlora\n", "adapter: lora\n")
    spec, sources, warned, path = _read(tmp_path, "cce.yml", text + plugin)
    assert spec.cut_cross_entropy and sources["cut_cross_entropy"] == f"{path}: plugins"
    spec, *_ = _read(tmp_path, "off.yml", text + plugin + "cut_cross_entropy: false\n")
    assert not spec.cut_cross_entropy
    spec, *_ = _read(tmp_path, "none.yml", text)
    assert not spec.cut_cross_entropy


def test_axolotl_adapters_in_the_model_dtype(tmp_path):
    # peft_autocast_adapter_dtype: false -> get_peft_model(autocast_adapter_dtype=False): the
    # adapters stay bf16, priced so for plain LoRA; over the 4-bit base still fp32, warned
    lora = AXOLOTL_QLORA.replace("adapter: qlora\n", "adapter: lora\n").replace(
        "load_in_4bit: true", "load_in_4bit: false")
    spec, sources, warned, path = _read(tmp_path, "a.yml",
                                        lora + "peft_autocast_adapter_dtype: false\n")
    assert (spec.precision, spec.adapter_dtype) == ("bf16", "bf16")
    assert sources["adapter_dtype"] == f"{path}: peft_autocast_adapter_dtype"
    spec, _, warned, _ = _read(tmp_path, "q.yml",
                               AXOLOTL_QLORA + "peft_autocast_adapter_dtype: false\n")
    assert spec.adapter_dtype == "fp32"
    assert any("peft_autocast_adapter_dtype" in w for w in warned)
