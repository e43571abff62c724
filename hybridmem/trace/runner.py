"""Run the real training step of a spec on fake or meta tensors, watched by the storage tracker.

Each iteration is what HF Trainer's `training_step` does on one GPU: forward with labels (HF's
own loss), drop the outputs, backward, optimizer step, `zero_grad(set_to_none=True)`; the
spec's loop changes that (`train`): `loop="custom"` keeps the output object, `grad_accum` runs
several forward/backward micro-steps per step, `max_grad_norm` clips before the step,
`empty_cache_steps` marks `torch.cuda.empty_cache()` on the tracker where the loop calls it. Mixed
precision is `torch.autocast` over the forward (CPU autocast on fake tensors, CUDA's lists
emulated on meta tensors; see `corrections` and `autocast`). fp16-mixed scales the loss and
unscales grads in place, as GradScaler does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from hybridmem.errors import SpecError
from hybridmem.job.checkpointing import enable_checkpointing
from hybridmem import techniques
from hybridmem.techniques import offload_hooks as offload
from hybridmem.techniques.offload import STUCK
from hybridmem.techniques import optim_in_backward
from hybridmem.techniques.liger import liger_note
from hybridmem.techniques.liger_kernels import rope_patched
from hybridmem.families import family
from hybridmem.models.build import part_of
from hybridmem.job.spec import TrainingSpec, empty_cache_at
from hybridmem.torch_dtype import AUTOCAST, PARAM_DTYPE
from hybridmem import objectives
from hybridmem.objectives import steps
from hybridmem.trace import corrections, model as build
from hybridmem.trace.autocast import (CudaAutocast, emulated, meta_torch_autocast,
                                      wrap_checkpointing)
from hybridmem.models.loader import is_analytic
from hybridmem.trace.inputs import batch_notes, make_batch
from hybridmem.trace.optimizers import (
    fused_on_meta,
    host_state_keys,
    make_lorafa,
    make_optimizer,
    paged_tensors,
)
from hybridmem.trace.quantized import quant_state_tensors
from hybridmem.trace.tracker import StorageTracker

ITERATIONS = 2  # optimizer state appears in the first step; the second shows the steady peak

LOSS_SCALE = 2.0**16  # torch.amp.GradScaler default init_scale


class TraceDeclined(Exception):
    """A tracker that cannot record this run stops it (`repeat.NotRepeatable`): it reaches the
    caller as is, not as a model whose training step cannot run."""


@dataclass
class Job:
    """Everything one traced run needs, built under the fake mode."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: dict
    trainable: list[tuple[str, nn.Parameter]]
    masters: list[torch.Tensor] = field(default_factory=list)
    image_tokens: int = 0
    """Image tokens per sample in `batch` (all images of a sample)."""
    amp: CudaAutocast | None = None
    """Emulated CUDA autocast (meta backend with a *-mixed precision), else None."""
    grad_bytes: dict[int, int] = field(default_factory=dict)
    after_step: list[int] = field(default_factory=list)
    """Tracker event index right after each `optimizer.step()` (grads and state still live)."""
    """id(param) -> bytes of its .grad storage, for params that received one."""
    outputs: object | None = None
    """The output object `loop="custom"` holds (the last forward's), else None."""
    notes: list[str] = field(default_factory=list)
    """What the build decided that the user should read (text-only batch, LoRA targets)."""
    liger: str | None = None
    """The text model type whose Liger kernels are patched in (`--liger`), else None."""
    fused: bool = False
    """The SFT step runs TRL's fused LM head (`objectives.steps.uses_fused_head`)."""
    copies: offload.Copies | None = None
    """Host / device copies of offloaded activations (`spec.offload_activations`), else None."""
    offloader: offload.Offload | None = None
    """TRL's offloading hooks around each forward + backward (`offload_activations="all"`)."""
    ref: nn.Module | None = None
    """The separate reference model (`objectives.ref_model_of` "separate"), else None."""
    tracker: StorageTracker | None = None
    """The run's tracker (objectives relabel the reference's and the generation's tensors)."""
    micro: int = 0
    """The micro-step running (GRPO's slice of its generation batch)."""
    grpo: dict | None = None
    """GRPO's generated ids, advantages and reference log-probs of the current step."""


def _master_copies(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """fp32 master weights for bf16 params (DeepSpeed `bf16_optimizer.py`), optimizer-owned."""
    return [p.detach().float().requires_grad_(True) for p in params]


def prepare(spec: TrainingSpec, config) -> Job:
    """Model, frozen parts, LoRA, checkpointing, optimizer and batch, as for a CUDA run."""
    model = build.build_model(spec, config)
    build.freeze(model, spec)
    build.quantize(model, spec)  # --quantize: bitsandbytes Linears, peft's kbit-training casts
    spec = build.lora_targets_for(model, spec, config)  # the default's meaning for this family
    if spec.train in ("lora", "peft"):  # PEFT adapters: LoRA/DoRA or any adapter_config.json
        model = build.add_adapters(model, spec)
    liger = build.apply_loss(model, spec, config)  # Trainer: after PEFT, before checkpointing
    fused = steps.uses_fused_head(spec)
    if fused:  # SFTTrainer: after Trainer.__init__ (PEFT), on the unwrapped model
        steps.add_fused_head(model, spec)
    if spec.grad_ckpt:
        enable_checkpointing(model, spec)
    copies = offload.Copies() if spec.offload_activations != "none" else None
    if spec.offload_activations == "ckpt-inputs":  # save_on_cpu around each checkpoint call
        offload.enable_ckpt_offload(model, lambda: offload.SaveOnHost(copies.to_host,
                                                                      copies.to_device))
    # peft's LoRA-FA factory freezes every lora_A: built before the trainable params are taken
    lorafa = make_lorafa(model, spec.lora) if spec.optimizer == "lora-fa" else None
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in trainable]
    masters = _master_copies(params) if spec.precision == "bf16-master" else []
    # optimizer-in-backward: one optimizer per parameter, stepped in its grad hook
    optimizer = techniques.optimizer(spec, masters or params,
                                     lambda ps: make_optimizer(spec.optimizer, ps),
                                     step=_stepped_as_on_cuda)
    if optimizer is None:
        optimizer = lorafa if lorafa is not None else make_optimizer(spec.optimizer,
                                                                     masters or params)
    pixel_dtype = PARAM_DTYPE[spec.precision]
    batch, image_tokens = make_batch(spec, config, model, pixel_dtype)
    if not objectives.lm_loss(spec):  # the trainer's collated batch (its step.batch)
        objectives.check_model(spec, image_tokens, config.model_type)
        batch = objectives.batch(spec, fused=fused)
    elif fused:
        batch = objectives.collate(spec, batch)
    elif spec.padded:  # the collator's attention mask with its padding (`spec.padded`)
        batch = {**batch, "attention_mask": steps.padded_mask(batch["input_ids"])}
    job = Job(model, optimizer, batch, trainable, masters, image_tokens, copies=copies)
    job.ref = steps.reference_model(spec, config, build.build_model)
    if fused:
        steps.add_fused_reference_head(job.ref)
    job.liger = liger
    job.fused = fused
    if spec.offload_activations == "all":  # TRL get_act_offloading_ctx_manager(model)
        job.offloader = offload.Offload(copies.to_host, copies.to_device,
                                        params=[*model.parameters(), *model.buffers()])
        offload.keep_head(model).__enter__()  # hooks stay for the model's life, as in TRL
    job.notes.extend(batch_notes(spec, config))
    if spec.liger and liger is None:
        job.notes.append(liger_note(config.model_type))
    if spec.train == "lora" and not is_analytic(config.model_type):
        job.notes.append(f"lora: adapters on {', '.join(spec.lora.targets)}")
    return job


def _call(job: Job, spec: TrainingSpec) -> tuple[torch.Tensor, object | None]:
    """(loss, the output object if the loop keeps it).

    `trainer` (transformers `Trainer.compute_loss` returns the loss only): the output object,
    logits included, dies before autocast's cache is cleared, as in a Trainer run. `custom`
    (`outputs = model(**batch); loss = outputs.loss`, huggingface/peft
    method_comparison/MetaMathQA/run.py): the caller holds it."""
    if not objectives.lm_loss(spec) or job.fused:  # the TRL trainer's compute_loss (step.loss)
        return objectives.loss(job, spec, job.micro), None
    if spec.loop == "custom":
        out = job.model(**job.batch, use_cache=False)
        return out.loss, out
    return job.model(**job.batch, use_cache=False).loss, None


def _forward(job: Job, spec: TrainingSpec) -> tuple[torch.Tensor, object | None]:
    with _loss_autocast(job, spec):
        return _call(job, spec)


@contextlib.contextmanager
def _loss_autocast(job: Job, spec: TrainingSpec):
    """The loss's autocast (`Trainer.compute_loss_context_manager`; GRPOTrainer's
    `accelerator.autocast()` around each fused forward): the emulated CUDA autocast on meta
    tensors, torch's CPU autocast otherwise, nothing without a *-mixed precision."""
    if job.amp is not None:
        with job.amp.region(True):
            yield
        return
    ctx = (torch.autocast("cpu", dtype=AUTOCAST[spec.precision]) if spec.precision in AUTOCAST
           else contextlib.nullcontext())
    if spec.precision in AUTOCAST:
        # checkpoint recomputes run in backward, outside this block: CUDA's fp32 norms there
        # too (checkpoint.py restores the autocast state; a half weight's fp32 cast must recur)
        wrap_checkpointing(job.model, None, corrections.CudaAutocastFp32)
    with ctx, corrections.cuda_autocast_rules(spec.precision in AUTOCAST):
        yield


@contextlib.contextmanager
def _fake_item():
    """`Tensor.item()` on a fake tensor returns 1.0 (Adafactor reads norms and `step` with it).

    On CUDA `.item()` is a sync that allocates nothing; the value changes no allocation size.
    """
    item = torch.Tensor.item

    def fake_item(self):
        return 1.0 if isinstance(self, FakeTensor) or self.is_meta else item(self)

    torch.Tensor.item = fake_item
    try:
        yield
    finally:
        torch.Tensor.item = item


def _stepped_as_on_cuda(optimizer) -> None:
    """`optimizer.step()` with `.item()` answered as on a device (`_fake_item`)."""
    with _fake_item():
        optimizer.step()


def _label_in_backward(job: Job, spec: TrainingSpec, tracker: StorageTracker) -> None:
    """Optimizer-in-backward: the hooks step and free each grad inside backward, so the grad
    and the state it creates are labelled there (the loop's labels after backward and after
    the step would find no grad and the state already made)."""
    parts = {id(p): part_of(n) for n, p in job.trainable}
    host = host_state_keys(spec.optimizer)

    def before(param) -> None:
        tracker.label(param.grad, "grad", parts.get(id(param)))
        job.grad_bytes[id(param)] = param.grad.untyped_storage().nbytes()

    def after(param, opt) -> None:
        paged = {id(t) for t in paged_tensors(opt)}  # unified memory, off the allocator
        for key, t in opt.state[param].items():
            if isinstance(t, torch.Tensor):
                kind = "host" if key in host else "paged" if id(t) in paged else "optimizer"
                tracker.label(t, kind, parts.get(id(param)))

    job.optimizer.before_step, job.optimizer.on_step = before, after


def _optimizer_step(job: Job, spec: TrainingSpec, tracker: StorageTracker,
                    empty_cache: bool = False) -> None:
    """Unscale, master grads, clipping, `optimizer.step()`, then `zero_grad(set_to_none=True)`;
    `empty_cache` marks `torch.cuda.empty_cache()` between the step and zero_grad (the peft
    benchmark's place: its `zero_grad()` opens the next iteration)."""
    with torch.no_grad():
        if spec.precision == "fp16-mixed":  # GradScaler.unscale_: in place, no new memory
            torch._foreach_mul_([p.grad for _, p in job.trainable if p.grad is not None],
                                1.0 / LOSS_SCALE)
        for m, (name, p) in zip(job.masters, job.trainable):  # fp32 master grads (optimizer's)
            if p.grad is not None and m is not p:  # an fp32 param is its own master
                m.grad = p.grad.float()
                tracker.label(m.grad, "optimizer", part_of(name))
                p.grad = None
    if spec.max_grad_norm:
        clip(job.masters or [p for _, p in job.trainable], spec.max_grad_norm)
    with _fake_item():
        job.optimizer.step()
    with torch.no_grad():
        for m, (_, p) in zip(job.masters, job.trainable):
            if m is not p:
                p.copy_(m)
    job.after_step.append(len(tracker.events) - 1)
    if empty_cache:
        tracker.empty_cache()
    for t in getattr(job.optimizer, "qmaps", ()):
        tracker.label(t, "optimizer")
    host = host_state_keys(spec.optimizer)
    paged = {id(t) for t in paged_tensors(job.optimizer)}  # unified memory, off the allocator
    parts = {id(p): part_of(n) for n, p in job.trainable}
    parts.update({id(m): parts[id(p)] for m, (_, p) in zip(job.masters, job.trainable)})
    for param, state in job.optimizer.state.items():
        for key, t in state.items():
            if isinstance(t, torch.Tensor):
                kind = "host" if key in host else "paged" if id(t) in paged else "optimizer"
                tracker.label(t, kind,  # LoRA-FA: by name
                              part_of(param) if isinstance(param, str) else parts.get(id(param)))
    job.optimizer.zero_grad(set_to_none=True)
    for m, (_, p) in zip(job.masters, job.trainable):
        m.grad = p.grad = None


def clip(params: list[torch.Tensor], max_norm: float) -> None:
    """`torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)`: CUDA's default path
    (on CPU only an explicit `foreach=True` takes it), with CUDA's `_foreach_norm` scratch
    (`corrections.cuda_foreach_norm`). The returned total norm is dropped (as the peft
    benchmark does; Trainer keeps it, one 512 B block, through the step)."""
    with corrections.cuda_foreach_norm():
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def _micro_step(job: Job, spec: TrainingSpec, tracker: StorageTracker, it: int, micro: int,
                workspace: int, empty_cache: bool = False) -> None:
    """One forward + backward. The output object the loop keeps (`custom`) replaces
    `job.outputs` (the previous micro-step's) only once the new forward has returned.
    `empty_cache` marks `torch.cuda.empty_cache()` between the forward and the backward
    (`Trainer.training_step`: after `compute_loss`, before the loss is divided)."""
    with job.offloader if job.offloader is not None else contextlib.nullcontext():
        _forward_backward(job, spec, tracker, it, micro, workspace, empty_cache)


def _forward_backward(job: Job, spec: TrainingSpec, tracker: StorageTracker, it: int,
                      micro: int, workspace: int, empty_cache: bool) -> None:
    """`_micro_step`'s body (inside TRL's offloading context when it is on: SFTTrainer wraps
    the whole `training_step`, forward and backward)."""
    first = it == 0 and micro == 0
    job.micro = micro
    tracker.mark("forward", it)
    if workspace and first:
        tracker.add_external(workspace, "workspace")
    start = len(tracker.events)
    loss, outputs = _forward(job, spec)
    job.outputs = outputs  # `outputs = model(**batch)`: the previous output object dies here
    del outputs
    # what the forward made and still holds is what autograd saved for backward
    tracker.label_alive_since(start, "activation")
    tracker.mark("backward", it)
    if empty_cache:
        tracker.empty_cache()
    if workspace and first:
        tracker.add_external(workspace, "workspace")
    trainer_divides, accelerate_divides = objectives.loop_divisions(spec)
    if trainer_divides:  # transformers Trainer.training_step: loss / accumulation steps
        loss = loss / spec.grad_accum
    held = loss  # Trainer.training_step's `loss`, which it returns detached after backward
    if accelerate_divides:  # accelerate `Accelerator.backward`: `loss / accumulation steps`,
        loss = loss / 1  # a new 0-dim tensor beside the step's
    (loss * LOSS_SCALE if spec.precision == "fp16-mixed" else loss).backward()
    del loss, held
    for name, p in job.trainable:
        if p.grad is not None:
            tracker.label(p.grad, "grad", part_of(name))
            job.grad_bytes[id(p)] = p.grad.untyped_storage().nbytes()


def train(job: Job, spec: TrainingSpec, tracker: StorageTracker, iterations: int,
          workspace: int = 0) -> None:
    """`iterations` full training iterations, phases marked on the tracker.

    Each is `spec.grad_accum` micro-steps of forward + backward (later ones accumulate into
    the grads the first made: AccumulateGrad adds in place), then clipping and the optimizer
    step. Under `loop="custom"` each output object lives until the next forward returns (a
    loop variable rebound by the next `outputs = model(**batch)`).
    `workspace` > 0 adds the two cuBLAS workspaces where CUDA creates them: the forward
    thread's at the first matmul, the autograd device thread's at the first backward matmul.
    `spec.empty_cache_steps` > 0 marks `torch.cuda.empty_cache()` where `empty_cache_at`
    places it (after each forward of the iteration, or after its optimizer step).
    """
    if isinstance(job.optimizer, optim_in_backward.InBackward):
        _label_in_backward(job, spec, tracker)
    if job.copies is not None:  # a tensor brought back from the host is an activation
        job.copies.label = lambda t: tracker.label(t, "activation")
    job.tracker = tracker
    for it in range(iterations):
        where = empty_cache_at(spec, it)
        if objectives.of(spec).GENERATES:  # the step's completions, before its first forward
            tracker.mark("generation", it)
            objectives.prepare(job, spec, autocast=lambda: _loss_autocast(job, spec))
        for micro in range(spec.grad_accum):
            _micro_step(job, spec, tracker, it, micro, workspace, where == "after_forward")
        tracker.mark("optimizer", it)
        _optimizer_step(job, spec, tracker, where == "after_step")
        job.grpo = None  # the step's generation buffers die with the step
    job.outputs = None
    if job.offloader is not None and job.offloader.tracker:
        job.notes.append(STUCK + f"{len(job.offloader.tracker)} packed tensors left, "
                         "priced as TRL runs them")


BACKENDS = ("fake", "meta", "real")


@contextlib.contextmanager
def _quiet_fake_log():
    """FakeTensorMode logs a full traceback (`log.exception`, ~160 lines on stderr) before it
    re-raises a meta kernel's refusal; the refusal itself becomes the trace tier's one-line
    `UnsupportedModelError`, so the log is only noise in front of it."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    saved, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = saved


def _import_bnb_outside(spec: TrainingSpec) -> None:
    """Import bitsandbytes (when installed) before fake / meta tensors are on: PEFT imports it
    lazily while adding adapters, and its module-level tables (`backends/default/ops.py`
    `CODE`, the NF4/FP4 code books) would otherwise be built as fake or meta tensors and break
    every later real quantisation in the process (a real CPU bnb run after a traced LoRA)."""
    import importlib.util

    adapters = spec.train != "full" or spec.quantize != "none"
    if adapters and importlib.util.find_spec("bitsandbytes"):
        import bitsandbytes  # noqa: F401


@contextlib.contextmanager
def _tensors(backend: str, spec: TrainingSpec, model_type: str = ""):
    """Where tensors live: CPU fakes (FakeTensorMode), meta tensors, or real CPU tensors.

    `meta` is the fast path: meta kernels run in C++ where FakeTensorMode runs Python per op
    (2.5x faster on LLaVA-1.5-7B); `torch.autocast` has no meta support, so CUDA autocast is
    emulated (`autocast.py`). `real` is for tiny models only (tests check fakes against it).
    """
    if backend not in BACKENDS:
        raise SpecError("backend", backend, BACKENDS)
    if backend != "real":
        _import_bnb_outside(spec)
    if backend == "fake":
        with FakeTensorMode(), _quiet_fake_log():
            yield None
    elif backend == "meta":
        amp = CudaAutocast(AUTOCAST[spec.precision]) if spec.precision in AUTOCAST else None
        fam = family(model_type)  # e.g. Qwen-VL reads image_grid_thw values
        grid = (fam.meta_patches() if fam is not None and fam.meta_patches is not None
                else contextlib.nullcontext())
        with torch.device("meta"), corrections.CpuSdpaOnMeta(), fused_on_meta(), grid, \
                (emulated(amp) if amp else contextlib.nullcontext()), meta_torch_autocast(amp):
            yield amp
    else:
        yield None


@contextlib.contextmanager
def prepared(spec: TrainingSpec, config, backend: str = "fake"):
    """`prepare(spec, config)` on `backend`'s tensors, model checks patched; the job stays usable
    (tensors, emulated autocast) until the block exits."""
    with _tensors(backend, spec, config.model_type) as amp, \
            corrections.patched_model_checks(spec.packing):
        job = prepare(spec, config)
        job.amp = amp
        if backend == "meta":
            wrap_checkpointing(job.model, amp, corrections.CpuSdpaOnMeta)
        with rope_patched(job.liger) if job.liger else contextlib.nullcontext(), \
                steps.head_fold(job):
            yield job


def trace(spec: TrainingSpec, config, iterations: int = ITERATIONS, backend: str = "fake",
          workspace: int = 0, tracker: StorageTracker | None = None
          ) -> tuple[StorageTracker, Job]:
    """Build and run `spec` without real memory; the tracker holds every allocation.
    `tracker`: a fresh one to record into (`repeat.LayeredTracker` for the fast path)."""
    tracker = StorageTracker() if tracker is None else tracker
    try:
        with prepared(spec, config, backend) as job, tracker, \
                tracker.watching(build.top_modules(job.model)), tracker.attached(job), \
                (build.scalar_branches() if spec.train == "peft" else contextlib.nullcontext()):
            for name, p in job.model.named_parameters():
                tracker.label(p, "param", part_of(name))
            for name, b in job.model.named_buffers():
                tracker.label(b, "param", part_of(name))
            if job.ref is not None:  # the frozen reference copy: its own part
                for t in [*job.ref.parameters(), *job.ref.buffers()]:
                    tracker.label(t, "param", steps.REFERENCE)
            for name, q in quant_state_tensors(job.model):  # real bnb layers' QuantState
                tracker.label(q, "param", part_of(name))
            for m, (name, _) in zip(job.masters, job.trainable):
                tracker.label(m, "optimizer", part_of(name))
            for t in job.batch.values():
                if isinstance(t, torch.Tensor):
                    tracker.label(t, "activation")
            train(job, spec, tracker, iterations, workspace)
    except (SpecError, TraceDeclined):
        raise
    except Exception as err:
        raise build.unsupported(spec, f"its training step cannot run under {backend} tensors",
                                err) from err
    return tracker, job
