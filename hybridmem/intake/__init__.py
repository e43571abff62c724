"""Intake: what a user gives (flags, an HTTP request, config files, a launcher's config) -> one
validated job and where each of its fields came from.

- `readers/`: the files of the libraries a job runs on: HF TrainingArguments / TRL configs,
  DeepSpeed JSON, PEFT's adapter config, BitsAndBytesConfig, FSDP's `fsdp_config`;
- `dialects/`: one module per launcher (LLaMA-Factory, axolotl, torchtune, accelerate) behind
  the small protocol of `dialects/protocol.py`, found by the registry in `dialects/__init__.py`;
- `config_keys.py` / `library_fields.py`: every key of a file is used, known to its library, or
  a warning; `recipes.py`: the LLaVA-1.5 recipes as data;
- `merge.py`: the layers stacked (recipe < launcher config < TrainingArguments < DeepSpeed <
  explicit values); `resolve.py`: the front doors' entry (the options -> the job).

Nothing here prices memory: the tiers and the parallel layer sit below and never import it.
"""
