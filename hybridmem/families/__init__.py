"""The model families hybridmem prices, one folder each (`hybridmem/families/<family>/`, the
layout of torchtitan's `models/<name>/`), and the registry the tiers read them through.

A family folder holds everything about the family: its `Family` records (`FAMILIES` in its
`__init__.py`, one per transformers `model_type`, and the small hook functions they point at),
its config reading and its presets (`presets/*.json`), its layer graph, its closed forms (the
`LayerKind`s its layers are priced by), its image-token rule and its meta-trace patches. The
tiers keep the shared mechanisms (the analytic timeline and alloc/free stream, the trace
runner) and reach a family only through its record; `common/` holds what the closed forms
share. Adding a family is its folder plus its tests.

Hooks import their implementation lazily, so importing the registry imports neither torch nor
transformers (the analytic tier must not: tests/test_models.py). Families not declared here
are still priced: the trace tier builds any transformers causal-LM or image-text-to-text
`model_type` (docs/trace.md "Which models").
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Callable, Mapping

VLM = "vlm"
DECODER = "decoder"

# Decoder traits (`Family.traits`) the decoder graph and its activation formulas switch on
# (common/decoder_graph.py, common/decoder_acts.py; docs/families.md):
QK_NORM = "qk_norm"   # RMSNorm over head_dim on q and k (modeling_qwen3.Qwen3Attention)
FUSED = "fused"       # one qkv_proj and one gate_up_proj whose outputs are sliced (modeling_phi3)
GEMMA = "gemma"       # four (1 + weight) norms per layer, scaled embedding (modeling_gemma2)
MOE = "moe"           # router + 3-D expert weights (modeling_mixtral.MixtralExperts)
NO_SDPA = "no_sdpa"   # `_supports_sdpa = False` in its transformers code (softcapping)
QKV_BIAS = "qkv_bias"    # bias=True on q/k/v only, hard-coded (modeling_qwen2.Qwen2Attention)
# local (sliding) and global layers: a RoPE table per layer type (Gemma3RotaryEmbedding), and
# SDPA masks the sliding layers once the sequence reaches the window (masking_utils)
SLIDING = "sliding"
TRAITS = (QK_NORM, FUSED, GEMMA, MOE, NO_SDPA, QKV_BIAS, SLIDING)


@dataclass(frozen=True, slots=True)
class Family:
    """Everything family-specific a tier reads, for one `model_type`."""

    model_type: str
    kind: str
    """`VLM` (built as image-text-to-text) or `DECODER` (causal LM)."""
    source: str
    """The transformers modeling file its rules follow."""
    text_defaults: Mapping[str, object] | None = None
    """Decoder: its transformers config class's defaults for the fields the light parser
    (`models/light.py`) reads."""
    sub_text_defaults: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """VLM: defaults of its text sub-config class, by that class's model_type, where the type is
    no decoder family of its own (Qwen3VLTextConfig)."""
    full_config: bool = False
    """VLM: transformers' own config class fills its many nested defaults (the analytic
    parser then reads a `PretrainedConfig`)."""
    check_config: Callable[[dict], None] | None = None
    """Validates the raw config's sub-config types (one-line SpecError)."""
    light_config: Callable[[dict], object] | None = None
    """VLM: the raw config dict -> the attributes the graph parser reads, without transformers
    (`models/light.py`); None with `full_config` (transformers' class) or LLaVA's default."""
    traits: frozenset[str] = frozenset()
    """Decoder traits (`TRAITS`)."""
    sub_types: tuple[str, ...] = ()
    """model_types of its sub-configs that share its traits (Qwen2-VL's `qwen2_vl_text`)."""
    image_plan: Callable | None = None
    """(config, (h, w) | None) -> `job.images.ImagePlan`: the one image-token rule."""
    hw_images: bool | Callable = False
    """`--image-size HxW` allowed (native dynamic resolution, image splitting); else a square
    side; a callable (config) -> bool where the tower decides (LLaVA with Pixtral)."""
    pixel_inputs: Callable | None = None
    """(config, plan, n_images, dtype, device, host_shapes) -> the processor's pixel outputs;
    None: one (n, 3, side, side) tensor."""
    pixel_mask: bool = False
    """Its processor also sends a bool `pixel_attention_mask` (crops, tile, tile)."""
    tower_input_grads: bool = True
    """Whether checkpointing's `enable_input_require_grads` hooks the vision tower too (so a
    frozen tower saves for backward); False where its `get_input_embeddings` raises
    (Qwen3VLVisionModel: only the LM's embed_tokens is hooked)."""
    text_extras: Callable | None = None
    """(config, image_mask (b, s) long tensor) -> extra integer inputs (token type ids)."""
    image_wrap: Callable | None = None
    """(config) -> (ids before, ids after) each image's tokens: the text marker tokens its chat
    template puts around every image (Qwen-VL's vision_start / vision_end; counted in
    `ImagePlan.markers`); None: the images' tokens lie in one run."""
    vision_graph: Callable | None = None
    """(cfg, spec, images, plan) -> (vision modules, `models.graph.ImageLayout`)."""
    vision_seq: Callable | None = None
    """(vision_config) -> tokens the tower sees per crop (0 for the packed native-resolution
    towers)."""
    lm_prefix: str = "model.language_model"
    """Where its language model sits in the transformers module tree."""
    lm_layers: Callable | None = None
    """Decoder: (text config, micro_batch, seq_len) -> its base model's layers (embed_tokens,
    rotary, decoder layers, norm) where they are not the shared decoder graph's
    (`common/decoder_graph.py language_model_layers`); None: that graph."""
    lm_graph: Callable | None = None
    """(cfg, spec, lm Module, images per sample, plan) -> the LM as the family runs it on a
    batch with images (Gemma 3's per-layer masks, Qwen3-VL's DeepStack adds); None: the
    decoder's graph as is."""
    meta_patches: Callable | None = None
    """() -> a context manager the trace needs under meta tensors (data-dependent helpers)."""
    count_check: bool = False
    """Its transformers module (`transformers.models.<model_type>.modeling_<model_type>`)
    checks the image-token count by reading tensor values: `torch_compilable_check` in 5.x,
    `get_placeholder_mask`'s `inputs_embeds[mask].numel()` in 4.57. The trace's batch has
    exactly the rule's image tokens, so the trace makes the check a no-op
    (`trace.corrections.patched_model_checks`, `trace.compat.placeholder_patches`)."""
    parts: tuple[tuple[str, str], ...] = ()
    """(name fragment, part) pairs placing its transformers parameter / module names in the
    graph's top-level parts (`models.build.part_of`; the first match wins, then the shared
    fragments `models.build.PART_FRAGMENTS`): what the trace tier and the harness freeze."""
    default_layer_types: Callable[[object], list[str]] | None = None
    """Decoder: (text config) -> its per-layer attention types where the config lists none
    (Gemma 3's local / global pattern); None: every layer full attention."""
    experts: Callable[[object], dict] | None = None
    """Decoder with `MOE`: (text config) -> its experts' fields and router rules as the layer's
    dims read them: experts, top_k, ffn (an expert's intermediate size), router_copy (softmax
    of an fp32 copy), router_norm (top-k weights renormalised), router_fp32_weights."""
    sparse_layer: Callable[[object, int], bool] | None = None
    """Decoder with `MOE`: (text config, layer index) -> whether the layer has the sparse
    block; None: every layer has it."""
    techniques: frozenset[str] = frozenset()
    """The model-patching techniques (`techniques/<name>.py` `NAME`) whose patch of this
    model_type is priced; a VLM that lists one is patched through its LM (Liger's
    `apply_liger_kernel_to_llava`), so its LM family must list it too (`target`)."""
    layer_kinds: Callable[[], Mapping[str, LayerKind]] | None = None
    """() -> {layer kind: `LayerKind`} for the layers its graph makes (and the formula variants
    its layers name, `models.graph.Layer.formula`): how the analytic tier prices them."""

    def has(self, trait: str) -> bool:
        return trait in self.traits


@dataclass(frozen=True, slots=True)
class LayerKind:
    """How the analytic tier prices one layer kind (`models.graph.Layer.kind`)."""

    acts: Callable
    """The closed form of what the layer keeps for backward: (layer, `Ctx`, need_in, need_w)
    -> `Acts` (the decoder's `embedding` takes the tied grad and whether image features are
    merged too, its `rotary` (layer, ctx, active))."""
    checkpointed: bool = False
    """A `GradientCheckpointingLayer` in transformers: `--grad-ckpt` recomputes it."""
    linear: bool = False
    """Its 2-D weights are `nn.Linear`s (bitsandbytes' `replace_with_bnb_linear` converts them)."""
    sac_as: Callable | None = None
    """(layer) -> the layer as the shared kind whose op-level checkpointing cache it has
    (`analytic.sac`; Pixtral's block is a Llama decoder layer over one packed sequence)."""
    pixel_bytes: Callable | None = None
    """(layer, graph, model-dtype bytes) -> bytes of the processor's pixel inputs this layer
    reads (alive the whole iteration: `analytic.estimate.batch_bytes`); None: none."""
    packed: bool = False
    """Its `dims["n"]` counts the patches of one packed native-resolution sequence (the
    analytic answer's note on what the tower encodes)."""
    dims: type | None = None
    """The `TypedDict` of the layer's `dims` (`models.graph.Layer.dims`): the keys its closed
    form reads and their types, declared where the graph builds them; `dims_problems` checks a
    layer against it (tests/test_layer_dims.py, over every preset's graph)."""


def dims_problems(layer) -> list[str]:
    """How a graph layer's `dims` break its priced kind's declared `LayerKind.dims`: a key the
    type does not declare, a required key missing, a value of another type (a bool is not an
    int here). Empty where they fit; a kind with no declared type is itself a problem."""
    import typing

    name = layer.formula or layer.kind
    declared = layer_kind(name).dims
    if declared is None:
        return [f"{name}: no LayerKind.dims declared"]
    hints = typing.get_type_hints(declared)
    out = [f"{name}.{key}: missing" for key in sorted(declared.__required_keys__ - set(layer.dims))]
    for key, value in layer.dims.items():
        want = hints.get(key)
        if want is None:
            out.append(f"{name}.{key}: not declared in {declared.__name__}")
            continue
        want = typing.get_origin(want) or want
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            out.append(f"{name}.{key}: {type(value).__name__}, declared {want.__name__}")
    return out


class UnpricedLayerKind(LookupError):
    """A graph made a layer of a kind no family registered closed forms for."""


def check_sub_config(data: dict, key: str, allowed: tuple[str, ...], default: str) -> None:
    """A nested config's `model_type` (`default`: its config class's when the JSON leaves it
    out) must be one the closed forms price: the one sub-config check of every family's
    `check_config` (one-line SpecError naming the field)."""
    from hybridmem.errors import SpecError

    sub = data.get(key)
    if isinstance(sub, dict) and sub.get("model_type", default) not in allowed:
        raise SpecError(f"{key}.model_type", sub.get("model_type"), allowed)


def check_text_config(data: dict, default: str = "llama") -> None:
    """`text_config.model_type` (default `default`, the config class's) must be a decoder
    family with closed forms: the LM is priced by the decoder closed form
    (`families/common/decoder_acts.py`)."""
    check_sub_config(data, "text_config", types(DECODER), default)


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.ispkg:  # a family is a folder; `common/` declares none
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for fam in getattr(module, "FAMILIES", ()):
            if fam.model_type in found:
                raise RuntimeError(f"model_type {fam.model_type!r} declared twice "
                                   f"(hybridmem/families/{info.name}/)")
            if fam.kind not in (VLM, DECODER) or not set(fam.traits) <= set(TRAITS):
                raise RuntimeError(f"{fam.model_type}: bad kind {fam.kind!r} or traits")
            found[fam.model_type] = fam
    return found


REGISTRY: dict[str, Family] = _discover()


@lru_cache(maxsize=1)
def layer_kinds() -> dict[str, LayerKind]:
    """Every registered layer kind (`Family.layer_kinds`); a kind two families register
    differently is refused."""
    out: dict[str, LayerKind] = {}
    for mt, fam in REGISTRY.items():
        for kind, lk in (fam.layer_kinds() if fam.layer_kinds is not None else {}).items():
            if out.setdefault(kind, lk) != lk:
                raise RuntimeError(f"layer kind {kind!r} registered twice ({mt})")
    return out


def layer_kind(kind: str) -> LayerKind:
    """The registered `LayerKind`; a kind no family registered is an error naming it (never
    priced as keeping nothing)."""
    try:
        return layer_kinds()[kind]
    except KeyError:
        raise UnpricedLayerKind(f"layer kind {kind!r}: no family registers closed forms for it "
                                "(hybridmem/families/<family>/, Family.layer_kinds)") from None


def family(model_type: str | None) -> Family | None:
    """The declared family of `model_type`, None for families only the trace tier knows."""
    return REGISTRY.get(model_type) if isinstance(model_type, str) else None


def types(kind: str | None = None, *,
          where: Callable[[Family], bool] | None = None) -> tuple[str, ...]:
    """model_types of the declared families (in declaration order), filtered. Every declared
    family has closed forms; the others are the trace tier's alone."""
    return tuple(mt for mt, f in REGISTRY.items()
                 if (kind is None or f.kind == kind) and (where is None or where(f)))


def target(model_type: str, text_type: str | None = None):
    """The model as the techniques see it (`techniques.protocol.Target`): which techniques'
    patches of it are priced (`Family.techniques`; a VLM that lists one is patched through its
    LM, whose family must list it too) and the model_type the library's patch is chosen by."""
    from hybridmem.techniques.protocol import Target

    fam = family(model_type)
    listed = {}
    for mt, f in REGISTRY.items():
        for name in f.techniques:
            listed[name] = (*listed.get(name, ()), mt)
    if fam is not None and fam.kind == VLM and fam.techniques:
        text = family(text_type)
        return Target(model_type, text_type,
                      fam.techniques & (text.techniques if text is not None else frozenset()),
                      listed)
    return Target(model_type, model_type, fam.techniques if fam is not None else frozenset(),
                  listed)


def text_family(model_type: str | None) -> Family | None:
    """The declared decoder family of a text config's `model_type`, its own or one of its
    `sub_types` (Qwen3-VL-MoE's `qwen3_vl_moe_text` is Qwen3-MoE's); None for the others."""
    for mt, f in REGISTRY.items():
        if f.kind == DECODER and (model_type == mt or model_type in f.sub_types):
            return f
    return None


def with_trait(trait: str) -> tuple[str, ...]:
    """model_types (and sub-config types) with a decoder trait."""
    out: list[str] = []
    for mt, f in REGISTRY.items():
        if f.has(trait):
            out += [mt, *f.sub_types]
    return tuple(out)
