"""The model graph: top-level modules -> layers -> parameter tensors, with the shapes that the
analytic tier needs.

A `Layer` is the unit the analytic tier prices: one parameter-holding block whose activations
follow one formula (`kind`). Parameter names are the suffixes below the layer's own name, as
`named_parameters()` of the `transformers` model prints them, so counts can be checked against a
meta-device instantiation tensor by tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter (or buffer) tensor."""

    name: str
    """Suffix below the layer name, e.g. `self_attn.q_proj.weight`."""
    shape: tuple[int, ...]
    itemsize: int | None = None
    """Fixed bytes per element (buffers, LoRA adapters); None = the precision policy's dtype."""
    frozen: bool = False
    """An adapter tensor with requires_grad=False (LoRA-FA's lora_A): memory, no grad, no state;
    autograd saves nothing for its weight grad."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def linear(prefix: str, n_out: int, n_in: int, bias: bool) -> tuple[ParamTensor, ...]:
    """An `nn.Linear`'s parameters: `{prefix}.weight` (out x in), and `{prefix}.bias`."""
    w = (ParamTensor(f"{prefix}.weight", (n_out, n_in)),)
    return w + ((ParamTensor(f"{prefix}.bias", (n_out,)),) if bias else ())


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    """One block of a module, priced by one activation formula (`kind`)."""

    name: str
    """Dotted path below the top-level module, e.g. `layers.3`."""
    kind: str
    """What the layer is: decoder_layer, encoder_layer, embedding, ... (a kind a family
    registers, `hybridmem.families.LayerKind`); the key of its closed form unless `formula`
    names another."""
    formula: str = ""
    """A family's own closed form for a layer of a shared kind (InternViT's layer-scaled
    encoder layer), registered under this name; empty: the kind's."""
    scope: str = ""
    """Prefix of the parameter names inside the module, e.g. `layers.3` (empty: none)."""
    params: tuple[ParamTensor, ...] = ()
    buffers: tuple[ParamTensor, ...] = ()
    """Registered buffers (rotary frequencies, position ids): memory, but not parameters."""
    lora: tuple[ParamTensor, ...] = ()
    """LoRA adapter tensors added by PEFT (fp32), when train='lora'."""
    copies: tuple[ParamTensor, ...] = ()
    """Trainable copies of frozen params (PEFT `modules_to_save`): params, grads, state."""
    quantized: tuple[str, ...] = ()
    """Names (in `params`) of the Linear weights bitsandbytes quantises (`--quantize`): priced
    by `hybridmem.techniques.quantize.Quant.weight_allocs` instead of the policy's dtype."""
    trainable: bool = False
    """The base params have requires_grad=True under the spec's `train` mode."""
    on_grad_path: bool = True
    """The layer's output reaches the loss; False e.g. for CLIP layers after vision_feature_layer."""
    runs: bool = True
    """The layer runs in the forward (a vision tower does not run when there are no images)."""
    dims: dict = field(default_factory=dict)
    """Shapes and traits its closed form reads (b, s, h, heads, kv_heads, head_dim, ffn, ...):
    a plain dict whose keys and types its kind declares as a `TypedDict`
    (`families.LayerKind.dims`, checked over every preset's graph by tests/test_layer_dims.py)."""

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def gets_grads(self) -> bool:
        """Base params receive .grad tensors (and hence optimizer state)."""
        return self.trainable and self.on_grad_path and self.runs

    @property
    def grad_tensors(self) -> tuple[ParamTensor, ...]:
        """The tensors that get a .grad (and optimizer state): base params when `gets_grads`,
        LoRA adapters (but frozen ones) and modules_to_save copies whenever the layer runs."""
        return (self.params if self.gets_grads else ()) + (
            tuple(p for p in self.lora if not p.frozen) + self.copies if self.runs else ())


@dataclass(frozen=True, slots=True, kw_only=True)
class Module:
    """A top-level part of the model (vision_tower, multi_modal_projector, language_model, ...)."""

    name: str
    prefix: str
    """Its path in the HF CausalLM model (`model.vision_tower`, `lm_head`, `model`)."""
    layers: tuple[Layer, ...]

    @property
    def num_params(self) -> int:
        return sum(layer.num_params for layer in self.layers)

    @property
    def num_lora_params(self) -> int:
        return sum(p.numel for layer in self.layers for p in layer.lora)

    @property
    def num_copy_params(self) -> int:
        """Parameters of PEFT `modules_to_save` copies."""
        return sum(p.numel for layer in self.layers for p in layer.copies)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelGraph:
    """The parsed model with the spec's shapes applied (batch, sequence, images)."""

    model: str
    """Display name (preset or path)."""
    model_type: str
    modules: tuple[Module, ...]
    vocab_size: int
    text_hidden: int
    micro_batch: int
    seq_len: int
    image_tokens: int = 0
    """Image tokens per sample inside `seq_len` (all images of the sample)."""
    vision_batch: int = 0
    """Crops the vision tower sees per step (micro_batch x images x crops per image)."""
    vision_seq: int = 0
    """Tokens per crop inside the vision tower (patches, + CLS for CLIP)."""
    tied_embeddings: bool = False
    notes: tuple[str, ...] = ()

    @property
    def num_params(self) -> int:
        return sum(m.num_params for m in self.modules)

    def param_names(self) -> dict[str, int]:
        """Full `named_parameters()` name -> numel, as the HF CausalLM model prints them."""
        out = {}
        for m in self.modules:
            for layer in m.layers:
                for p in layer.params:
                    out[".".join(x for x in (m.prefix, layer.scope, p.name) if x)] = p.numel
        return out

    def module(self, name: str) -> Module:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    def layers(self):
        """(module name, layer) pairs in forward order."""
        for m in self.modules:
            for layer in m.layers:
                yield m.name, layer


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """What a VLM family's vision side hands the language model, per image
    (`Family.vision_graph`)."""

    crops: int
    """Crops per image the vision tower encodes (1 for LLaVA-1.5; tiles + 1 base for NeXT)."""
    features_per_crop: int
    """Tokens per crop entering the projector (after the select strategy)."""
    tokens: int
    """Image tokens per image in the language model's sequence."""
    newlines: int = 0
    """`image_newline` tokens among them (LLaVA-NeXT)."""
