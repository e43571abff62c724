"""Run order and cost of sweep configs, so that a run cut off early still covers the space.

`space_filling_order` is greedy max-min (farthest-point) selection under the Hamming distance
between configs' axis values: each next config differs from every config already chosen in as
many axes as possible; among equally new ones the cheapest goes first. Any prefix of the order
is then spread over all axes, and the first rounds are cheap.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

# Rough H200 timings, used only to order configs and to print an estimate; they are
# assumptions to be replaced by measured `wall_seconds`, not facts.
STARTUP_S = 8.0
"""Fresh Python + import torch/transformers + CUDA context, per config (assumed)."""
INIT_PARAMS_PER_S = 2e9
"""Random init of parameters on the GPU incl. transformers' per-module init loop (assumed)."""
PEAK_FLOPS = 989e12
"""H200 dense BF16 tensor-core peak (NVIDIA H200 datasheet, same as H100 SXM)."""
TORCHRUN_S = 10.0
"""torchrun, its rendezvous and the process group of a multi-rank config (assumed; 13 s for a
2-rank CPU/gloo launch of a tiny model on this 2-core machine, import time included)."""
MFU = 0.3
"""Assumed model-FLOPs utilisation of an eager HF training step."""


def param_count(config: dict) -> int:
    """Approximate parameters of a Llama / LLaVA config dict (attention, MLP, embeddings)."""
    total = 0
    text = config.get("text_config", config)
    h, i, n = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    total += n * (2 * h * h + 2 * h * (h // heads) * kv + 3 * h * i) + 2 * text["vocab_size"] * h
    vision = config.get("vision_config")
    if vision:
        # Qwen-VL towers name their blocks `depth` (Qwen2-VL: width `embed_dim`, MLP
        # `mlp_ratio` x; configuration_qwen2_vl.py Qwen2VLVisionConfig)
        vh = vision.get("embed_dim") or vision["hidden_size"]
        vi = vision.get("intermediate_size") or int(vh * vision.get("mlp_ratio", 4))
        layers = vision.get("num_hidden_layers") or vision.get("depth", 0)
        total += layers * (4 * vh * vh + 2 * vh * vi) + vh * h + h * h
    return total


def estimate_seconds(config: dict, tokens: int, iterations: int, grad_ckpt: bool,
                     launched: bool = False) -> float:
    """Wall seconds of one config (startup + init + steps at 6 FLOPs/param/token), rough.

    Each rank of a multi-rank config runs its own micro-batch in parallel: same step time,
    plus the launch (`launched`)."""
    params = param_count(config)
    flops = 6 * params * tokens * (4 / 3 if grad_ckpt else 1)  # checkpointing: one more forward
    return STARTUP_S + TORCHRUN_S * launched + params / INIT_PARAMS_PER_S + iterations * flops / (PEAK_FLOPS * MFU)


def space_filling_order(keys: Sequence[Sequence[Hashable]], costs: Sequence[float]) -> list[int]:
    """Indices of `keys` (one tuple of axis values per config) in max-min Hamming order."""
    n = len(keys)
    if n == 0:
        return []
    width = len(keys[0])
    codes = np.empty((n, width), dtype=np.int64)
    for a in range(width):
        seen: dict = {}
        codes[:, a] = [seen.setdefault(k[a], len(seen)) for k in keys]
    cost = np.asarray(costs, dtype=float)
    min_dist = np.full(n, width + 1)  # distance to the chosen set; "infinite" before the first
    free = np.ones(n, dtype=bool)
    order: list[int] = []
    for _ in range(n):
        best = min_dist[free].max()
        candidates = np.flatnonzero(free & (min_dist == best))
        pick = int(candidates[np.argmin(cost[candidates])])
        order.append(pick)
        free[pick] = False
        min_dist = np.minimum(min_dist, (codes != codes[pick]).sum(axis=1))
    return order
