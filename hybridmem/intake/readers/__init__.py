"""The files of the libraries a job runs on, each read as its library reads it, into one layer
of TrainingSpec keyword arguments with the source of every field: `trainer` (HF Trainer's
inputs: TrainingArguments, TRL's trainer configs and the DeepSpeed JSON resolved from them, and
the helpers the readers share), `peft`, `bnb` (BitsAndBytesConfig), `fsdp` (`fsdp_config`,
shared with the launchers)."""
