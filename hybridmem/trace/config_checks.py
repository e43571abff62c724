"""Config values a transformers model cannot be built with, as one-line `SpecError`s.

Why: a hand-written tiny config.json keeps the family's default special-token ids (Mllama's
text `pad_token_id` 128004) beside a tiny vocabulary; `nn.Embedding(vocab, h, padding_idx)`
then asserts (torch/nn/modules/sparse.py `Embedding.__init__`: "Padding_idx must be within
num_embeddings"), which would surface as "cannot be built under fake tensors" although no
backend could build it. Checked before building, naming the field.
"""

from __future__ import annotations

from hybridmem.errors import SpecError


def check_token_ids(config) -> None:
    """`pad_token_id` (the embedding's padding_idx) must index the text vocabulary."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    pad = getattr(text, "pad_token_id", None)
    if isinstance(vocab, int) and isinstance(pad, int) and not -vocab <= pad < vocab:
        field = "pad_token_id" if text is config else "text_config.pad_token_id"
        raise SpecError(field, pad, reason=f"must be below vocab_size={vocab} (the token "
                        "embedding's padding_idx); set it in the config")
