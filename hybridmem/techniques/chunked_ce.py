"""torchtune's chunked cross-entropy (`--loss chunked-ce --chunked-ce N`, `--chunked-ce N`):
the output projection in N chunks, each upcast to fp32 inside the loss
(`CEWithChunkedOutputLoss`): its rules and its loss in torch, in one module.

Source, torchtune 0.6.1 (PyPI): `modules/loss/ce_chunked_output_loss.py`
`CEWithChunkedOutputLoss` with `TransformerDecoder.chunked_output` (`modules/transformer.py`):
the output projection runs on `h.chunk(N, dim=1)` (N logits tensors in the compute dtype, all
alive until the loss is computed) and each chunk is upcast to fp32 inside the loss, one at a time.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.techniques.kernels import IGNORE_INDEX, shift_labels, torch_chunks
from hybridmem.techniques.protocol import Target

NAME = "chunked-ce"
AXIS = "loss"
FLAG = "chunked_ce"
OBJECTIVES: tuple[str, ...] = ("sft",)  # priced with the LM loss only
DEFAULT_CHUNKS = 8  # torchtune's recipes: `num_output_chunks = 8` (ce_chunked_output_loss.py)


def active(spec) -> bool:
    return bool(spec.chunked_ce)


def check(spec) -> None:
    n = spec.chunked_ce
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise SpecError("chunked_ce", n, reason="must be a non-negative integer (0 = off)")


def applies(target: Target) -> bool:
    return True  # a plain-torch loss on any causal LM's lm_head


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    """The output keeps the list of chunks (`chunked_loss_forward`)."""
    return [(b * n * vocab, e) for n in torch_chunks(s, spec.chunked_ce)]


def note(spec, model_type: str, applies: bool) -> str | None:
    return (f"chunked_ce: the logits in {spec.chunked_ce} chunks, each upcast to fp32 inside the "
            "loss (torchtune CEWithChunkedOutputLoss)")


def install(model, spec, target: Target) -> str | None:
    apply_chunked_ce(model, spec.chunked_ce)
    return None


def apply_real(model, spec) -> None:
    apply_chunked_ce(model, spec.chunked_ce)


# ------------------------------------------------------------------ the loss in torch

def chunked_cross_entropy(logits: list, labels, ignore_index: int = IGNORE_INDEX):
    """torchtune `CEWithChunkedOutputLoss.forward` (ce_chunked_output_loss.py), line for line:
    the chunks of `labels` follow the logits chunks; each chunk upcast with `.float()` inside
    `F.cross_entropy(reduction="sum")`, the sum divided by the number of counted tokens."""
    import torch.nn.functional as F

    total_elements = (labels != ignore_index).sum()
    labels = [c.reshape(-1) for c in labels.chunk(len(logits), dim=1)]
    logits = [c.reshape(-1, c.size(-1)) for c in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(logits, labels):
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk,
                                      ignore_index=ignore_index, reduction="sum")
    return total_loss / total_elements



def chunked_loss_forward(n_chunks: int):
    """A causal-LM `forward` (bound to the HF model instance) whose output projection emits
    `n_chunks` logits chunks (torchtune `TransformerDecoder.chunked_output`) and whose loss is
    `chunked_cross_entropy`; the output keeps the list of chunks as its `logits`."""
    def forward(self, input_ids=None, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = self.model(input_ids=input_ids, **kwargs)
        h = outputs[0]
        logits = [self.lm_head(chunk) for chunk in h.chunk(n_chunks, dim=1)]
        loss = None
        if labels is not None:
            loss = chunked_cross_entropy(logits, shift_labels(labels))
        return CausalLMOutputWithPast(loss=loss, logits=logits)
    return forward


def apply_chunked_ce(model, n_chunks: int) -> None:
    """Patch the causal LM instance (PEFT-unwrapped) as torchtune's recipes run it."""
    from types import MethodType

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.forward = MethodType(chunked_loss_forward(n_chunks), base)
