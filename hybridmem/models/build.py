"""`build_graph(spec)`: the model graph with the spec's shapes, trainable flags and LoRA adapters.

Model-dependent validation lives here, at the boundary: image size, images in a text-only
model, image tokens longer than the sequence, LoRA targets that match nothing, `train` modes
the model has no part for.
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.job.lora_targets import default_targets
from hybridmem.errors import SpecError
from hybridmem.techniques.quantize import quant_of
from hybridmem.families.common.decoder_graph import language_model_layers, lm_head_layer
from hybridmem.models.graph import ImageLayout, Layer, ModelGraph, Module, ParamTensor as T
from hybridmem.families import DECODER, attention, family, layer_kind
from hybridmem.families.common.images import image_plan
from hybridmem.job.images import check_seq_len, images_in_batch
from hybridmem.models.light import light_config
from hybridmem.job.precision import adapter_bytes
from hybridmem.job.spec import POLICIES, LoraSpec, TrainingSpec

# Which top-level modules train under each `train` mode. LLaVA stage 1 (`projector`) trains only
# the projector; stage 2 (`llm+projector`) everything but the vision tower
# (haotian-liu/LLaVA scripts/v1_5/pretrain.sh, finetune.sh; docs/design.md).
TRAINABLE_MODULES: dict[str, frozenset[str]] = {
    "full": frozenset({"vision_tower", "multi_modal_projector", "image_newline",
                       "language_model", "lm_head"}),
    "llm+projector": frozenset({"multi_modal_projector", "image_newline", "language_model",
                                "lm_head"}),
    "projector": frozenset({"multi_modal_projector"}),
    # the language model alone: LLaMA-Factory's full fine-tuning of a VLM by default
    # (model/adapter.py `_setup_full_tuning` freezes `get_forbidden_modules`, the vision tower
    # and the projector: hparams/finetuning_args.py freeze_vision_tower and
    # freeze_multi_modal_projector default True); LLaVA-NeXT's image_newline is neither
    "llm": frozenset({"image_newline", "language_model", "lm_head"}),
    "lora": frozenset(),
    # any other PEFT method (`adapters.spec_fields`): the base model is frozen, PEFT decides
    # what trains; priced by the trace tier only
    "peft": frozenset(),
}

# Top-level part a real (HF) parameter / module name belongs to, by the first matching name
# fragment; the same names as this graph's modules, so the trace tier and the CUDA harness
# freeze exactly what the analytic tier prices.
PARTS: tuple[str, ...] = ("vision_tower", "multi_modal_projector", "image_newline", "lm_head")
# The same parts by the names transformers' VLMs commonly give them (fragment -> part, the first
# match wins), for the families the trace tier alone prices; a declared family's own names
# (`Family.parts`) are matched first. Checked on tiny models in tests/test_generic.py
# (per-part counts).
PART_FRAGMENTS: tuple[tuple[str, str], ...] = (
    ("multi_modal_projector", "multi_modal_projector"),  # LLaVA, PaliGemma, Gemma 3, Mllama
    ("merger", "multi_modal_projector"),     # a projector nested in its vision module
    ("connector", "multi_modal_projector"),  # Idefics3 / SmolVLM `model.connector`
    ("image_newline", "image_newline"),      # LLaVA-NeXT
    ("vision_tower", "vision_tower"),        # LLaVA, PaliGemma, Gemma 3
    ("visual", "vision_tower"),              # Qwen2-VL `model.visual`
    ("vision", "vision_tower"),              # Idefics3 / Mllama `model.vision_model`, ...
    ("lm_head", "lm_head"),
)
# Fragments of the parts LoRA leaves alone (vision tower, projector): LLaVA's
# `find_all_linear_names` skips them; `adapters.lora_llm_pattern` excludes them.
NON_LM_FRAGMENTS: tuple[str, ...] = tuple(f for f, part in PART_FRAGMENTS if part != "lm_head")


def part_of(name: str, model_type: str | None = None) -> str:
    """Top-level part of a dotted parameter/module name of a `model_type` model
    (`language_model` if none matches)."""
    fam = family(model_type)
    for fragment, part in (*(fam.parts if fam is not None else ()), *PART_FRAGMENTS):
        if fragment in name:
            return part
    return "language_model"


DECODER_TRAINS: tuple[str, ...] = ("full", "lora", "peft")
LORA_FP32 = 4  # PEFT `autocast_adapter_dtype=True` (default) keeps adapters in float32
# LoRA goes on language-model linears only, as LLaVA's `find_all_linear_names` does (it skips
# the vision tower and the projector); `lm_head` only when named explicitly.
LORA_MODULES = ("language_model", "lm_head")


def _decoder_modules(cfg, spec: TrainingSpec, lm_prefix: str) -> tuple[Module, Module]:
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    tc = getattr(cfg, "text_config", cfg)
    own = family(tc.model_type)  # a decoder family with its own layers (`Family.lm_layers`)
    layers = own.lm_layers if own is not None and own.lm_layers is not None \
        else language_model_layers
    lm = Module(name="language_model", prefix=lm_prefix,
                layers=layers(tc, spec.micro_batch, spec.seq_len))
    head = Module(name="lm_head", prefix="lm_head",
                  layers=(lm_head_layer(tc, spec.micro_batch, spec.seq_len, tied),))
    return lm, head


def _lora_adapters(layer: Layer, module: Module, lora: LoraSpec, frozen_a: bool = False,
                   itemsize: int | None = LORA_FP32) -> Layer:
    """PEFT `LoraLayer`: lora_A (r x in) and lora_B (out x r) on every matching Linear; DoRA
    adds `lora_magnitude_vector` (out,), the fp32 column norms of W + scale B@A at init
    (peft/tuners/lora/dora.py `DoraLinearLayer.update_layer`). `frozen_a`: LoRA-FA's
    `create_lorafa_optimizer` sets `requires_grad_(False)` on every lora_A
    (peft/optimizers/lorafa.py). `itemsize` None: adapters in the weights' dtype
    (`job.precision.adapter_bytes`), priced by the precision policy as the base's params."""
    adapters = []
    for p in layer.params:
        if not p.name.endswith("weight") or len(p.shape) != 2 or layer.kind == "embedding":
            continue
        linear = p.name[: -len(".weight")] if p.name != "weight" else ""
        if lora.targets_module(_full_name(module, layer, linear)):
            n_out, n_in = p.shape
            prefix = f"{linear}." if linear else ""
            adapters += [T(f"{prefix}lora_A.default.weight", (lora.r, n_in), itemsize,
                           frozen=frozen_a),
                         T(f"{prefix}lora_B.default.weight", (n_out, lora.r), itemsize)]
            if lora.use_dora:
                adapters.append(T(f"{prefix}lora_magnitude_vector.default.weight", (n_out,),
                                  LORA_FP32))
    return replace(layer, lora=tuple(adapters))


def _full_name(module: Module, layer: Layer, linear: str) -> str:
    """A linear's module name in the transformers model (`model.language_model.layers.0.
    self_attn.q_proj`): what PEFT matches `target_modules` against."""
    return ".".join(x for x in (module.prefix, layer.scope, linear) if x)


def _regex_outside_lm(modules: list[Module], lora: LoraSpec) -> str | None:
    """The first linear outside the language model and lm_head a target regex adapts (the
    closed forms put adapters on the LLM's linears only), or None."""
    for m in modules:
        if m.name in LORA_MODULES:
            continue
        for layer in m.layers:
            for p in layer.params:
                # any weight module peft could wrap (Linear, Conv, Embedding)
                if p.name.endswith("weight") and len(p.shape) >= 2:
                    name = _full_name(m, layer, p.name[: -len(".weight")])
                    if lora.targets_module(name):
                        return name
    return None


def _own_weights(layer: Layer, vocab: int, hidden: int) -> tuple[T, ...]:
    """The layer's parameters as its nn.Module holds them (a tied lm_head holds the
    embedding's weight, which the graph counts at embed_tokens)."""
    if layer.kind == "lm_head" and not layer.params:
        return (T("weight", (vocab, hidden)),)
    return layer.params


def _saved_copies(layer: Layer, prefix: str, names: tuple[str, ...], vocab: int,
                  hidden: int) -> Layer:
    """PEFT `modules_to_save`: `ModulesToSaveWrapper` deep-copies every module whose name is
    a target or ends with `.target` (peft/utils/other.py); the copy, in the base dtype (it is
    no tuner layer, so `autocast_adapter_dtype` leaves it), trains, the original stays frozen.
    A parameter is copied when any module above it matches."""
    copies = []
    for p in _own_weights(layer, vocab, hidden):
        path = [x for x in (prefix, layer.scope) if x] + p.name.split(".")[:-1]
        mods = [".".join(path[:i]) for i in range(1, len(path) + 1)]
        if any(m == t or m.endswith("." + t) for m in mods for t in names):
            copies.append(T(f"modules_to_save.default.{p.name}", p.shape, p.itemsize))
    return replace(layer, copies=tuple(copies))


def _lora_target_names(modules: list[Module]) -> list[str]:
    names = set()
    for m in modules:
        if m.name in LORA_MODULES:
            for layer in m.layers:
                if layer.kind in ("decoder_layer", "lm_head"):
                    names |= {(p.name[: -len(".weight")].split(".")[-1] if p.name != "weight"
                               else m.name) for p in layer.params if len(p.shape) == 2}
    return sorted(names)


def _apply_training(modules: list[Module], spec: TrainingSpec, vocab: int,
                    hidden: int) -> list[Module]:
    trainable = TRAINABLE_MODULES[spec.train]
    if spec.train == "lora":
        names = [n for n in _lora_target_names(modules) if n != "lm_head"]
        spec = spec.with_(lora=default_targets(spec.lora, names))  # the default's meaning
    out = []
    for m in modules:
        layers = tuple(replace(layer, trainable=m.name in trainable) for layer in m.layers)
        if spec.train == "lora" and m.name in LORA_MODULES:
            layers = tuple(_lora_adapters(layer, m, spec.lora, spec.optimizer == "lora-fa",
                                          adapter_bytes(spec.adapter_dtype))
                           for layer in layers)
        if spec.train == "lora" and spec.lora.modules_to_save:
            layers = tuple(_saved_copies(layer, m.prefix, spec.lora.modules_to_save, vocab,
                                         hidden) for layer in layers)
        out.append(replace(m, layers=layers))
    regex = spec.lora.target_regex if spec.train == "lora" else None
    if regex is not None:
        outside = _regex_outside_lm(out, spec.lora)
        if outside is not None:
            raise SpecError("lora.target_regex", regex, reason=f"also adapts {outside} (outside "
                            "the language model), which the closed forms do not price: "
                            "--method trace prices it")
    if spec.train == "lora" and not any(layer.lora for m in out for layer in m.layers):
        if regex is not None:
            sample = _sample_linear(out)
            raise SpecError("lora.target_regex", regex, reason="peft full-matches it against "
                            f"whole module names, such as {sample!r}, and it matches none")
        raise SpecError("lora.targets", ",".join(spec.lora.targets), _lora_target_names(out),
                        reason="matches no module")
    if spec.train == "lora" and spec.lora.modules_to_save and not any(
            layer.copies for m in out for layer in m.layers):
        raise SpecError("lora.modules_to_save", ",".join(spec.lora.modules_to_save),
                        reason="matches no module of the model")
    return out


def _sample_linear(modules: list[Module]) -> str:
    """The first language-model linear's full name (what a target regex must match)."""
    for m in modules:
        for layer in m.layers if m.name == "language_model" else ():
            for p in layer.params:
                if layer.kind == "decoder_layer" and p.name.endswith("weight") \
                        and len(p.shape) == 2:
                    return _full_name(m, layer, p.name[: -len(".weight")])
    return ""


def _quantize(modules: list[Module], spec: TrainingSpec) -> list[Module]:
    """Mark the Linear weights bitsandbytes quantises (`hybridmem.techniques.quantize`)."""
    quant = quant_of(spec)
    if quant is None:
        return modules
    out = []
    for m in modules:
        layers = []
        for layer in m.layers:
            names = tuple(
                p.name for p in layer.params
                # 2-D weights of nn.Linear modules (`LayerKind.linear`; embeddings, patch /
                # position embeddings are not: `replace_with_bnb_linear` converts nn.Linear only)
                if layer_kind(layer.kind).linear and p.name.endswith("weight")
                and len(p.shape) == 2
                and quant.converts(".".join(x for x in (m.prefix, layer.scope,
                                                        p.name[: -len(".weight")]
                                                        if p.name != "weight" else "") if x)))
            layer = replace(layer, quantized=names)
            if quant.kbit_prep and POLICIES[spec.precision].param_bytes == 2:
                # peft prepare_model_for_kbit_training: every fp16/bf16 parameter that is not
                # quantised becomes fp32 (buffers stay); modules_to_save copies are made after
                layer = replace(layer, params=tuple(
                    p if p.name in names or p.itemsize is not None else replace(p, itemsize=4)
                    for p in layer.params), copies=tuple(
                    p if p.itemsize is not None else replace(p, itemsize=4) for p in layer.copies))
            layers.append(layer)
        out.append(replace(m, layers=tuple(layers)))
    return out


def build_graph(spec: TrainingSpec) -> ModelGraph:
    """Parse the spec's model config into modules -> layers with the spec's shapes."""
    from hybridmem.families.defaults import as_job  # it reads this package's loader

    spec = as_job(spec)  # the models' Python entry: a Job as it is
    name, cfg = light_config(spec.model)
    fam = family(cfg.model_type)
    attention.check(cfg.model_type, fam.kind, spec.attn)  # as the installed transformers says
    multimodal = fam.kind != DECODER
    images = images_in_batch(spec, multimodal)
    if not multimodal:
        if spec.train not in DECODER_TRAINS:
            raise SpecError("train", spec.train, DECODER_TRAINS,
                            reason=f"{cfg.model_type} has no vision tower or projector")
        modules = list(_decoder_modules(cfg, spec, "model"))
        layout = ImageLayout(crops=0, features_per_crop=0, tokens=0)
    else:
        plan = image_plan(cfg, spec.image_size)  # the one rule (families/common/images.py)
        check_seq_len(spec.seq_len, images, plan)
        modules, layout = fam.vision_graph(cfg, spec, images, plan)  # the family's parts
        lm, head = _decoder_modules(cfg, spec, fam.lm_prefix)
        if fam.lm_graph is not None:
            lm = fam.lm_graph(cfg, spec, lm, images, plan)
        modules = modules + [lm, head]
    vc = getattr(cfg, "vision_config", None)
    tc = getattr(cfg, "text_config", cfg)
    modules = _quantize(_apply_training(modules, spec, tc.vocab_size, tc.hidden_size), spec)
    return ModelGraph(
        model=name, model_type=cfg.model_type, modules=tuple(modules),
        vocab_size=tc.vocab_size, text_hidden=tc.hidden_size, micro_batch=spec.micro_batch,
        seq_len=spec.seq_len, image_tokens=images * layout.tokens,
        vision_batch=spec.micro_batch * images * layout.crops,
        vision_seq=fam.vision_seq(vc) if multimodal else 0,  # the family's tower
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))
