"""OLMo 2 (`olmo2`; hybridmem/families/olmo2/, docs/families.md): a decoder family whose layers
are not Llama's (post-norms, q/k norms over the projection width), added as one folder.

Oracles: the transformers model built on the meta device (parameter count; every tensor's
shape is checked for each preset in tests/test_models.py) and a real CPU forward of one
`Olmo2DecoderLayer` (what it keeps for backward, counted by storage address). The trace tier
against a real CPU training loop and the analytic tier against the trace tier run in
tests/test_families.py (tiny-olmo2 is in its grid).
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridmem import TrainingSpec
from hybridmem.allocator.alloc import t
from hybridmem.models import build_graph, load_config
from test_trace import DataPtrCounter


def test_olmo2_7b_parameters_equal_the_meta_model():
    from transformers import AutoModelForCausalLM

    # olmo-2-1124-7b.json: hidden 4096, MLP 11008, 32 layers, 32 heads = kv heads, vocab
    # 100352, untied. Per layer q/k/v/o 4 x 4096², the MLP 3 x 4096 x 11008, q_norm, k_norm and
    # the two post-norms 4 x 4096; embed_tokens + lm_head 2 x 100352 x 4096, the final norm 4096
    # (7.30 B: the model card's "7B")
    hand = 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 4 * 4096) + 2 * 100352 * 4096 + 4096
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(load_config("olmo-2-1124-7b"))
    graph = build_graph(TrainingSpec(model="olmo-2-1124-7b", micro_batch=1, seq_len=16))
    assert graph.num_params == sum(p.numel() for p in ref.parameters()) == hand


@pytest.mark.parametrize("trains", [True, False], ids=["weights-train", "input-grad-only"])
@pytest.mark.parametrize("dtype, e", [(torch.float32, 4), (torch.bfloat16, 2)],
                         ids=["fp32", "bf16"])
def test_a_layer_keeps_what_a_real_cpu_forward_keeps(dtype, e, trains):
    """One decoder layer's forward on real CPU tensors (SDPA, pure precision): the storages
    alive after it, less its output, are what autograd keeps; the closed form must give the
    same bytes."""
    from transformers import AutoModelForCausalLM

    from hybridmem.families import layer_kind
    from hybridmem.families.common.activations import Ctx

    b, s = 2, 64
    config = load_config("tiny-olmo2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    layer = model.model.layers[0]
    model.requires_grad_(False)
    layer.requires_grad_(trains)
    x = torch.randn(b, s, config.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(s)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    counter = DataPtrCounter([*model.parameters(), *model.buffers(), x, cos, sin])
    base = counter.current
    with counter:
        out = layer(x, position_embeddings=(cos, sin), position_ids=pos)
    kept = counter.current - base - t(out.numel(), e)

    graph = build_graph(TrainingSpec(model="tiny-olmo2", micro_batch=b, seq_len=s))
    lay = next(l for _, l in graph.layers() if l.kind == "decoder_layer")
    acts = layer_kind(lay.formula).acts(lay, Ctx(e=e, stream=e, amp=False, attn="sdpa"),
                                         True, trains)
    # q / k / v save the layer input itself for their weight grads: here it is `x`, which
    # the counter started with
    x_saved = t(b * s * config.hidden_size, e) if trains else 0
    assert kept == acts.saved - x_saved


def test_predict_prices_an_olmo2_config_with_the_analytic_tier(tmp_path):
    """A config.json of the family (not a preset) is priced by the closed forms."""
    from hybridmem.models.loader import load_config_dict
    from hybridmem.analytic.scope import refusal
    from hybridmem.predict import predict

    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_config_dict("tiny-olmo2")[1]))
    spec = TrainingSpec(model=str(path), micro_batch=2, seq_len=64, precision="bf16")
    assert refusal(spec) is None
    pred = predict(spec)
    # tiny-olmo2.json by hand: embed + lm_head 2 x 128 x 64, final norm 64, 2 layers x (q, o
    # 64 x 64, k, v 32 x 64, MLP 3 x 128 x 64, q_norm 64, k_norm 32, two post-norms 2 x 64)
    hand = 2 * 128 * 64 + 64 + 2 * (2 * 4096 + 2 * 2048 + 3 * 8192 + 64 + 32 + 128)
    assert pred.method == "analytic" and pred.params_total == hand
