"""Model configs (presets, files) and the config -> module/layer graph parser."""

from hybridmem.models.build import build_graph
from hybridmem.models.graph import Layer, ModelGraph, Module, ParamTensor
from hybridmem.models.light import light_config
from hybridmem.models.loader import (
    DECODER_TYPES,
    MULTIMODAL_TYPES,
    SUPPORTED_TYPES,
    load_config,
    load_config_dict,
    preset_names,
)

__all__ = ["DECODER_TYPES", "MULTIMODAL_TYPES", "SUPPORTED_TYPES", "Layer", "ModelGraph", "Module",
           "ParamTensor", "build_graph", "light_config", "load_config", "load_config_dict",
           "preset_names"]
