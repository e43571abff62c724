"""The objective plug-ins (`hybridmem.objectives`): the registry, the protocol every plug-in
provides, the analytic traits agreeing with the batch its torch step builds, and no objective
name compared outside the plug-ins (docs/design.md, "Where a newcomer adds things")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridmem import TrainingSpec, objectives
from hybridmem.errors import SpecError
from hybridmem.objectives.protocol import DEFAULTS, DERIVED, HEADS, LM_HEAD, REQUIRED

PACKAGE = Path(objectives.__file__).parent.parent  # hybridmem/


def test_the_registry_finds_every_objective_in_order():
    # the six objectives docs/objectives.md documents, the LM loss (the default) first
    assert objectives.OBJECTIVES == ("sft", "dpo", "orpo", "kto", "rm", "grpo")
    assert [n for n, o in objectives.REGISTRY.items() if o.LM_LOSS] == ["sft"]
    for name, plugin in objectives.REGISTRY.items():
        assert plugin.NAME == name
        assert all(hasattr(plugin, a) for a in (*REQUIRED, *DERIVED, *DEFAULTS))
    # the job field's choices are the registry's (hybridmem.job.spec)
    from hybridmem.job.schema import BY_KEY

    assert tuple(BY_KEY["objective"].choices) == objectives.OBJECTIVES


def test_an_unknown_objective_is_one_line_naming_the_choices():
    with pytest.raises(SpecError) as err:
        TrainingSpec(model="tiny-llama", objective="ppo")
    assert str(err.value) == ("objective='ppo' is not valid "
                              "(valid: sft, dpo, orpo, kto, rm, grpo)")


@pytest.mark.parametrize("name", [n for n, o in objectives.REGISTRY.items() if not o.LM_LOSS])
def test_batch_columns_match_the_steps_batch(name):
    """`BATCH_COLUMNS` / `PRECOMPUTED_COLUMNS` (what the analytic tier adds to the SFT batch's
    ids + labels) count the int64 (rows x seq) and fp32 per-sequence columns the trainer's
    collated batch has, as its `step.batch` builds it (the full-logits collators)."""
    import torch

    kw = dict(model="tiny-llama", micro_batch=2, seq_len=32, objective=name)
    if name == "grpo":
        kw.update(num_generations=2, max_completion_length=8)
    spec = TrainingSpec(**kw)
    plugin, rows = objectives.of(spec), objectives.rows(spec)
    batch = objectives.batch(spec, torch.device("meta"))
    columns = [v for v in batch.values() if v.dtype == torch.long and v.shape == (rows, 32)]
    assert len(columns) - 2 == plugin.BATCH_COLUMNS  # against SFT's ids and labels
    if plugin.PRECOMPUTED_COLUMNS:
        pre = objectives.batch(spec.with_(ref_model="precomputed"), torch.device("meta"))
        added = [k for k in pre if k not in batch]
        assert len(added) == plugin.PRECOMPUTED_COLUMNS
        assert all(pre[k].dtype == torch.float32 and pre[k].shape == (2,) for k in added)


def test_every_step_module_provides_the_protocols_hooks():
    from importlib import import_module

    for name, plugin in objectives.REGISTRY.items():
        step = import_module(f"hybridmem.objectives.{name}.step")
        assert callable(step.loss)
        assert callable(getattr(step, "collate" if plugin.LM_LOSS else "batch"))
        assert callable(getattr(step, "prepare", None)) == plugin.GENERATES


NAMES = "|".join(objectives.OBJECTIVES)
COMPARED = re.compile(  # `objective == "dpo"`, `o in ("orpo", ...)`, `"grpo" != objective`
    rf"""(objective["']?\)?|\bo) *(==|!=) *["']({NAMES})["']"""
    rf"""|(objective|\bo) +(not +)?in +[({{]*["']({NAMES})"""
    rf"""|["']({NAMES})["'] *(==|!=) *[a-z_.]*objective""")
# the TRL config reader's marker table, which names the configs the keys come from
STILL_NAMED = {"intake/readers/trl.py"}


def test_no_objective_name_is_compared_outside_the_plug_ins():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("objectives/"):
            continue
        if COMPARED.search(path.read_text()):
            found.add(rel)
    assert found == STILL_NAMED


def test_the_independence_contract_lists_every_objective():
    """pyproject.toml's "objectives are independent" contract names each plug-in: a new
    objective's folder joins it (else it could import another unseen)."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    contracts = {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}
    expected = {f"hybridmem.objectives.{n}" for n in objectives.OBJECTIVES}
    assert set(contracts["objectives are independent"]["modules"]) == expected
    assert set(contracts["objective helpers import no objective"]["forbidden_modules"]) == expected


def _plugin(**traits):
    """A stand-in objective sub-package with only `traits`."""
    from types import ModuleType

    module = ModuleType("hybridmem.objectives.fake")
    for name, value in traits.items():
        setattr(module, name, value)
    return module


def test_an_objective_without_a_head_is_refused_at_registration():
    """The head formula is never guessed: a plug-in that names none, or one the decoder
    families do not price, is an error when the registry loads it."""
    with pytest.raises(RuntimeError, match=r"objective hybridmem.objectives.fake: no HEAD "):
        objectives.register(_plugin(NAME="fake", ORDER=9))
    with pytest.raises(RuntimeError, match=r"HEAD 'logps' is not a head formula \(valid: lm, "):
        objectives.register(_plugin(NAME="fake", ORDER=9, HEAD="logps"))
    with pytest.raises(RuntimeError, match=r"LM_LOSS follow from HEAD, not declared"):
        objectives.register(_plugin(NAME="fake", ORDER=9, HEAD="score", LM_LOSS=False))


def test_a_plug_in_declares_only_what_differs_from_sft():
    """The registry gives every trait a plug-in leaves out SFT's step (one forward of
    micro_batch rows, SFT's ids + labels batch, no beta, reference or prompt mask, a loss
    SFTTrainer scales itself: the LM-loss step of `objectives/sft/step.py`), and LM_LOSS /
    SCORE_HEAD follow from its head."""
    plugin = objectives.register(_plugin(NAME="fake", ORDER=9, HEAD="logps_split"))
    spec = TrainingSpec(model="tiny-llama", micro_batch=3)
    assert (plugin.CONCATENATED, plugin.PADDED, plugin.GENERATES, plugin.UNSCALED_LOSS) == (
        False, False, False, False)
    assert (plugin.DEFAULT_BETA, plugin.BATCH_COLUMNS, plugin.PRECOMPUTED_COLUMNS) == (0, 0, 0)
    assert not plugin.reads_reference(spec) and plugin.prompt_length(spec) == 0
    assert plugin.FUSED_OUTPUTS is None  # no fused head unless its trainer has one
    assert plugin.micro_batch_step(spec) == 1 and plugin.at_micro_batch(spec, 2).micro_batch == 2
    assert plugin.check(spec) is None and plugin.note(spec) == ""
    assert not plugin.LM_LOSS and not plugin.SCORE_HEAD
    assert objectives.register(_plugin(NAME="fake", ORDER=9, HEAD="score")).SCORE_HEAD


def test_every_head_formula_has_the_decoder_familys_closed_form():
    """Each formula a plug-in may name is priced: `objective_acts.HEADS` holds all but the LM
    loss's, which is `decoder_acts.lm_head`'s own; each registered plug-in names one."""
    from hybridmem.families.common.objective_acts import HEADS as FORMULAS

    assert set(FORMULAS) == set(HEADS) - {LM_HEAD}
    assert {o.HEAD for o in objectives.REGISTRY.values()} == set(HEADS)
