"""Training objectives (SFT, DPO, ORPO, KTO, RM, GRPO): the rules every `TrainingSpec` checks
(`rules`), TRL's fused-head rule (`trl_head`), and each objective's step as its TRL trainer
runs it (`<name>/step.py`, torch: the trace tier and the harness), on the torch code they
share (`steps`)."""

from __future__ import annotations


def loss(job, spec, micro: int = 0):
    """The objective's loss of one micro-step (the runner's `model(**batch).loss`)."""
    from hybridmem.objectives.dpo.step import dpo_fused_loss, dpo_loss
    from hybridmem.objectives.grpo.step import grpo_fused_loss, grpo_loss
    from hybridmem.objectives.kto.step import kto_fused_loss, kto_loss
    from hybridmem.objectives.orpo.step import orpo_loss
    from hybridmem.objectives.rm.step import rm_loss
    from hybridmem.objectives.sft.step import sft_trl_loss

    o = spec.objective
    if o == "sft":  # TRL's SFTTrainer through its fused head (`uses_fused_head`)
        return sft_trl_loss(job, spec)
    if o == "dpo" and job.fused:
        return dpo_fused_loss(job, spec)
    if o == "kto" and job.fused:
        return kto_fused_loss(job, spec)
    if o == "grpo":
        return (grpo_fused_loss if job.fused else grpo_loss)(job, spec, micro)
    return {"dpo": dpo_loss, "orpo": orpo_loss, "kto": kto_loss, "rm": rm_loss}[o](job, spec)
