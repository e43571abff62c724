"""The one optimizer registry (hybridmem/job/optimizers.py) and what every tier reads from it.

- state bytes per optimizer vs hand derivations from each library's source;
- trace tier on tiny-llama vs the analytic tier on optimizer bytes (per module), every optimizer;
- the trace tier vs a real CPU run for the emulated layouts (bitsandbytes, lion-pytorch) and
  transformers' Adafactor;
- a DDP replica's step temporary == the single-GPU one, every optimizer (tiny and 3B Lion);
- paged state: outside allocated / reserved, in the device peak, not in the fit verdict;
- TrainingArguments `optim` names, incl. an unknown name's one-line error.
"""

from __future__ import annotations

import json

import pytest

from hybridmem.analytic import estimate as analytic
from hybridmem.analytic.estimate import setup
from hybridmem.errors import SpecError
from hybridmem.job.optimizers import HF_OPTIMS, OPTIMIZERS, Stepped, flat, from_hf, rule
from hybridmem.intake.merge import spec_from_inputs
from hybridmem.intake.readers.trainer import from_training_args
from hybridmem.families.defaults import as_job
from hybridmem.parallel.sharding import rank_states, replicated
from hybridmem.job.parallel import ParallelSpec
from hybridmem.parallel.states import model_tensors
from hybridmem.job.spec import OPTIMIZER_TRAINS, OPTIMIZERS as SPEC_OPTIMIZERS, TrainingSpec

trace = pytest.importorskip("hybridmem.trace")

PLAIN = [o for o in OPTIMIZERS if o not in OPTIMIZER_TRAINS]  # lora-fa: tests/test_lorafa.py
W = Stepped(64 * 128, (64, 128), 4)   # an fp32 64 x 128 weight
W16 = Stepped(64 * 128, (64, 128), 2)  # the same in bf16
V = Stepped(64, (64,), 4)              # an fp32 norm weight
BIG = Stepped(1024 * 128, (1024, 128), 4)  # >= 1e5 elements: bitsandbytes pages it


def nbytes(name: str, s: Stepped) -> int:
    return sum(n * i for n, i in rule(name).state(s))


def test_registry_names_are_the_spec_names():
    assert tuple(OPTIMIZERS) == SPEC_OPTIMIZERS
    assert {n: r.trains for n, r in OPTIMIZERS.items() if r.trains} == OPTIMIZER_TRAINS


# Hand derivations, per library source:
# torch/optim/adam.py `_init_group`: exp_avg, exp_avg_sq = zeros_like(p); fused: + a 4 B step.
# torch/optim/sgd.py: momentum_buffer like p.  torch/optim/_adafactor.py: row_var (rows),
# col_var (cols) in the grad's dtype; 1-D: variance (n).
# transformers/optimization.py Adafactor: fp32 row (64) + col (128) + the 0-dim RMS; 1-D: n fp32.
# lion-pytorch: exp_avg like p.  bitsandbytes/optim/optimizer.py `init_state`: 32-bit -> fp32
# states; 8-bit -> uint8 states + fp32 absmax per 256 elements (8192 / 256 = 32 blocks).
HAND = {
    "adamw": (2 * 8192 * 4, 2 * 8192 * 2, 2 * 64 * 4),
    "adamw-fused": (2 * 8192 * 4 + 4, 2 * 8192 * 2 + 4, 2 * 64 * 4 + 4),
    "adamw-8bit": (2 * 8192 + 2 * 32 * 4, 2 * 8192 + 2 * 32 * 4, 2 * 64 * 4),
    "paged-adamw-8bit": (2 * 8192 + 2 * 32 * 4, 2 * 8192 + 2 * 32 * 4, 2 * 64 * 4),
    "paged-adamw": (2 * 8192 * 4, 2 * 8192 * 4, 2 * 64 * 4),
    "sgd": (0, 0, 0),
    "sgd-momentum": (8192 * 4, 8192 * 2, 64 * 4),
    "adafactor": ((64 + 128) * 4, (64 + 128) * 2, 64 * 4),
    "hf-adafactor": ((64 + 128 + 1) * 4, (64 + 128 + 1) * 4, (64 + 1) * 4),
    "lion": (8192 * 4, 8192 * 2, 64 * 4),
    "lion-32bit": (8192 * 4, 8192 * 4, 64 * 4),
    "lion-8bit": (8192 + 32 * 4, 8192 + 32 * 4, 64 * 4),
    "paged-lion": (8192 * 4, 8192 * 4, 64 * 4),
    "paged-lion-8bit": (8192 + 32 * 4, 8192 + 32 * 4, 64 * 4),
    "lora-fa": (2 * 8192 * 4, 2 * 8192 * 2, 2 * 64 * 4),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_bytes_equal_hand_derivation(name):
    assert (nbytes(name, W), nbytes(name, W16), nbytes(name, V)) == HAND[name]
    assert not rule(name).paged_state(W)  # 8192 elements: under bnb's 1e5 paging threshold


def test_paged_and_flat_partition_layouts():
    # bitsandbytes `get_state_buffer`: >= 1e5 elements go to unified memory, absmax stays
    assert rule("paged-adamw").paged_state(BIG) == [(131072, 4)] * 2
    assert rule("paged-adamw").state(BIG) == []
    assert rule("paged-lion-8bit").paged_state(BIG) == [(131072, 1)]
    assert rule("paged-lion-8bit").state(BIG) == [(131072 // 256, 4)]
    # a flat 1-D ZeRO partition: Adafactor unfactored (one n-vector)
    assert rule("adafactor").state(flat(10**6)) == [(10**6, 4)]
    assert rule("hf-adafactor").state(flat(10**6)) == [(10**6, 4), (1, 4)]
    # qmaps: AdamW8bit moves `dynamic` and `udynamic` to the device, Lion8bit only `dynamic`
    assert rule("adamw-8bit").shared([W]) == [(256, 4)] * 2
    assert rule("lion-8bit").shared([W]) == [(256, 4)]
    assert rule("adamw-8bit").shared([V]) == []


def test_step_temporaries_by_hand():
    # foreach AdamW: one state-sized list (`_foreach_sqrt`); lion-pytorch: 2 x the largest tensor
    assert rule("adamw").temporary([W, V]) == 8192 * 4 + 64 * 4
    assert rule("lion").temporary([W, V]) == 2 * 8192 * 4
    for name in ("adamw-fused", "adamw-8bit", "paged-adamw", "lion-32bit", "lion-8bit", "sgd"):
        assert rule(name).temporary([W, V]) == 0, name
    # transformers Adafactor, one bf16 tensor: fp32 grad + fp32 param copy + update and the
    # new product (or grad**2 and +eps) = 4 fp32 copies, + the row and column factors
    assert rule("hf-adafactor").temporary([W16]) == 4 * 8192 * 4 + (64 + 128) * 4


def _tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64,
                           "precision": "bf16", **kw})


@pytest.mark.parametrize("name", PLAIN)
def test_trace_equals_analytic_on_optimizer_bytes(name):
    spec = _tiny(optimizer=name)
    a, tr = analytic(spec), trace.estimate(spec)
    am, tm = {m.name: m for m in a.modules}, {m.name: m for m in tr.modules}
    assert tm and all(am[n].optimizer == tm[n].optimizer for n in tm)
    assert a.paged_bytes == tr.paged_bytes == 0  # tiny-llama: every tensor < 1e5 elements


def _big_vocab(tmp_path) -> str:
    """tiny-llama with a 2048-token vocabulary: embed / lm_head 2048 x 64 = 131072 >= 1e5."""
    from hybridmem.models.loader import load_config_dict

    cfg = load_config_dict("tiny-llama")[1]
    cfg["vocab_size"] = 2048
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name", ["paged-adamw", "paged-lion-8bit"])
def test_paged_state_outside_the_allocator(tmp_path, name):
    spec = _tiny(model=_big_vocab(tmp_path), optimizer=name)
    a, tr = analytic(spec), trace.estimate(spec)
    per_elem = {"paged-adamw": 2 * 4, "paged-lion-8bit": 1}[name]  # `Bnb` states above
    hand = 2 * 131072 * per_elem  # embed_tokens + lm_head, the only tensors >= 1e5
    assert a.paged_bytes == tr.paged_bytes == hand
    for p in (a, tr):
        assert p.breakdown["context"] >= hand  # in the device peak while resident
        assert p.peak.device_bytes - p.peak.reserved_bytes >= hand
        assert any("paged optimizer state" in n for n in p.notes)
        # a GPU too small for the paged state alone still fits: the driver pages it out
        p2 = type(p)(**{**{f: getattr(p, f) for f in p.__dataclass_fields__},
                        "gpu_name": "x", "gpu_memory_bytes": p.peak.device_bytes - hand})
        assert p2.fits and not p2.fits_within(p.peak.device_bytes - hand - 1)
    assert {m.name: m.optimizer for m in a.modules} == {m.name: m.optimizer for m in tr.modules}


@pytest.mark.parametrize("name", ["lion", "lion-32bit", "lion-8bit", "adamw-8bit",
                                  "hf-adafactor"])
def test_trace_equals_a_real_cpu_run(name):
    from test_trace import real_cpu_peak

    spec = _tiny(optimizer=name, precision="fp32")
    assert trace.run_trace(spec).peak_allocated == real_cpu_peak(spec) + 2 * trace_workspace()


def trace_workspace() -> int:
    """The trace tier's cuBLAS workspace per handle (the real CPU run has none)."""
    from hybridmem.allocator.overheads import CUBLAS_WORKSPACE_BYTES

    return CUBLAS_WORKSPACE_BYTES


def test_paged_emulation_allocates_as_its_unpaged_twin_on_a_real_cpu_run(tmp_path):
    """On CPU the paged layout allocates the same tensors as bnb's 32-bit Lion; the trace tier
    just keeps the paged ones out of the device stream."""
    from test_trace import real_cpu_peak

    model = _big_vocab(tmp_path)
    paged = _tiny(model=model, optimizer="paged-lion", precision="fp32")
    twin = _tiny(model=model, optimizer="lion-32bit", precision="fp32")
    assert real_cpu_peak(paged) == real_cpu_peak(twin)
    assert trace.run_trace(paged).peak_allocated < trace.run_trace(twin).peak_allocated


def _opt_temp(spec: TrainingSpec) -> int:
    return setup(spec)[2].opt_temp


@pytest.mark.parametrize("name", PLAIN)
def test_ddp_replica_step_temporary_equals_single_gpu(name):
    spec = _tiny(optimizer=name, precision="bf16-mixed")
    ddp = spec.with_(parallel=ParallelSpec(world_size=2, strategy="ddp"))
    assert rank_states(ddp, model_tensors(ddp)).step_temporary == _opt_temp(spec)
    assert replicated(spec, model_tensors(spec)).paged == analytic(spec).paged_bytes


def test_ddp_lion_on_llama_3b_equals_single_gpu():
    # the drift this registry fixed: DDP priced Lion at 1 x all trainable fp32 elements
    # (11.97 GiB), the single GPU at 2 x the largest tensor (the embedding, 2.94 GiB)
    spec = TrainingSpec(model="llama-3.2-3b", optimizer="lion", seq_len=512)
    # `rank_states` takes a resolved job (its precision decided), as the tiers hand it on
    ddp = as_job(spec.with_(parallel=ParallelSpec(world_size=2, strategy="ddp")))
    single = _opt_temp(spec)
    # 128256 x 3072 fp32 embedding (meta-device count, tests/test_models.py), twice
    assert single == 2 * 128256 * 3072 * 4
    assert rank_states(ddp, model_tensors(ddp)).step_temporary == single


# --- TrainingArguments `optim` ------------------------------------------------------------

@pytest.mark.parametrize("hf,ours", [
    ("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw-fused"),
    ("adamw_bnb_8bit", "adamw-8bit"), ("adamw_8bit", "adamw-8bit"),
    ("paged_adamw_8bit", "paged-adamw-8bit"), ("paged_adamw_32bit", "paged-adamw"),
    ("adafactor", "hf-adafactor"), ("lion_8bit", "lion-8bit"), ("lion_32bit", "lion-32bit"),
    ("paged_lion_32bit", "paged-lion"), ("paged_lion_8bit", "paged-lion-8bit"), ("sgd", "sgd"),
])
def test_hf_names(hf, ours):
    assert from_hf(hf) == ours
    assert from_training_args({"optim": hf})["spec"]["optimizer"] == ours


def test_hf_names_exist_in_transformers():
    from transformers.training_args import OptimizerNames

    assert set(HF_OPTIMS) <= {o.value for o in OptimizerNames}


def test_sgd_momentum_from_optim_args():
    # transformers trainer_optimizer.py `_get_sgd`: momentum from optim_args
    assert from_training_args({"optim": "sgd", "optim_args": "momentum=0.9"})["spec"][
        "optimizer"] == "sgd-momentum"


@pytest.mark.parametrize("optim,match", [
    ("adamw_torch_4bit", r"^training_args.optim='adamw_torch_4bit' is not valid \(valid: "),
    ("galore_adamw", r"^training_args.optim='galore_adamw'.*GaLore"),
])
def test_unknown_or_refused_hf_name_is_one_line(optim, match):
    with pytest.raises(SpecError, match=match) as err:
        from_training_args({"optim": optim, "optim_target_modules": ["attn"]})
    assert "\n" not in str(err.value) and "adamw_torch" in str(err.value)


def test_training_args_give_the_same_spec_as_the_flags(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"optim": "paged_adamw_8bit", "bf16": True,
                                "per_device_train_batch_size": 2}))
    from_file = spec_from_inputs(training_args=str(args), overrides={"model": "tiny-llama"})
    flags = spec_from_inputs(overrides={"model": "tiny-llama", "optimizer": "paged-adamw-8bit",
                                        "precision": "bf16-mixed", "micro_batch": 2,
                                        "loop": "trainer", "max_grad_norm": 1.0})
    assert from_file.optimizer == "paged-adamw-8bit"
    assert from_file.with_(parallel=flags.parallel) == flags


@pytest.mark.parametrize("argv,match", [
    (["--optimizer", "adam"], "error: optimizer='adam' is not valid (valid: adamw, "),
    (["--training-args", "ARGS"], "error: training_args.optim='adamw_anyprecision' is not "),
])
def test_cli_bad_optimizer_exits_2(argv, match, tmp_path, capsys):
    from hybridmem.cli import main

    args = tmp_path / "args.json"
    args.write_text(json.dumps({"optim": "adamw_anyprecision"}))
    argv = [str(args) if a == "ARGS" else a for a in argv]
    assert main(["predict", "--model", "tiny-llama", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(match) and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("name", PLAIN)
def test_harness_cpu_stand_in_builds_the_emulation_and_steps(name):
    import torch

    from hybridmem.harness.workload import make_optimizer

    w = torch.nn.Parameter(torch.randn(1024, 128))  # >= 1e5 elements: paged where paged
    opt = make_optimizer(name, [w], device=torch.device("cpu"))
    w.grad = torch.randn_like(w)
    opt.step()
    r = rule(name)
    state = sum(t.numel() * t.element_size() for st in opt.state.values()
                for k, t in st.items() if isinstance(t, torch.Tensor) and k not in r.host_keys)
    s = Stepped(w.numel(), tuple(w.shape), 4)
    hand = sum(n * i for n, i in r.state(s) + r.paged_state(s))
    assert state == hand, name


def test_harness_on_cuda_without_bitsandbytes_is_an_error_row(monkeypatch):
    import sys

    import torch

    from hybridmem.harness.workload import Unavailable, make_optimizer

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    with pytest.raises(Unavailable, match=r"^optimizer 'paged-adamw-8bit' needs bitsandbytes"):
        make_optimizer("paged-adamw-8bit", [torch.nn.Parameter(torch.zeros(4))],
                       device=torch.device("cuda"))
