"""Which attention implementations a family's transformers class accepts, as the installed
transformers declares them.

Why: transformers itself decides. `PreTrainedModel` refuses `flash_attention_2` where the class
has `_supports_flash_attn = False` (`_flash_attn_can_dispatch`) and `sdpa` where it has
`_supports_sdpa = False` (`_sdpa_can_dispatch`), and both attributes default to False on
`PreTrainedModel` itself (modeling_utils.py), so a modeling file that says nothing supports
neither. A list of our own goes stale with every release (Gemma 3's VLM class dropped
FlashAttention for its bidirectional image mask; Gemma 2 has no SDPA for softcapping); this
reads the attributes off the class that builds the model (`...ForConditionalGeneration` for a
VLM, `...ForCausalLM` for a decoder) and its bases in the same file, from the source with `ast`,
so the analytic tier imports no transformers (tests/test_models.py). transformers 4.x spelled
FlashAttention's flag `_supports_flash_attn_2`; either counts.

Where the source does not say (no modeling file for that model_type, a class this reader cannot
follow), the answer is None: nothing is refused here, and the trace tier's build still asks
transformers.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path

from hybridmem.errors import SpecError

FLAGS: dict[str, tuple[str, ...]] = {
    "flash_attention_2": ("_supports_flash_attn", "_supports_flash_attn_2"),
    "sdpa": ("_supports_sdpa",),
}
"""attn_implementation -> the class attributes that allow it; `eager` needs none."""
SUFFIX = {"vlm": "ForConditionalGeneration", "decoder": "ForCausalLM"}
"""The class the model is built as, by family kind (`models.loader.auto_class`)."""


def _modeling_file(model_type: str) -> Path | None:
    spec = importlib.util.find_spec("transformers")  # a top-level name: nothing imported
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    # a text sub-config's type lives in its VLM's folder (gemma3_text: models/gemma3/)
    for folder in dict.fromkeys((model_type, model_type.removesuffix("_text"))):
        path = root / "models" / folder / f"modeling_{folder}.py"
        if path.is_file():
            return path
    return None


def _assigned(cls: ast.ClassDef) -> dict[str, bool]:
    """The class body's boolean assignments (`_supports_sdpa = True`, annotated or not)."""
    out = {}
    for node in cls.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, bool):
            out.update({t.id: value.value for t in targets if isinstance(t, ast.Name)})
    return out


@lru_cache(maxsize=64)
def declared(model_type: str, kind: str) -> tuple[str, dict[str, bool]] | None:
    """(class name, {attn_implementation: allowed}) for the class that builds `model_type`,
    read from the installed transformers' modeling file; None where it cannot be read."""
    path = _modeling_file(model_type)
    if path is None or kind not in SUFFIX:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    name = next((c for c in classes if c.endswith(SUFFIX[kind])), None)
    if name is None:
        return None
    attrs: dict[str, bool] = {}
    todo = [name]
    while todo:  # the class, then its bases (Python's order is close enough: first one wins)
        cls = classes.get(todo.pop(0))
        if cls is None:
            continue
        for key, value in _assigned(cls).items():
            attrs.setdefault(key, value)
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name)]
    # anything left unsaid is PreTrainedModel's own False (modeling_utils.py)
    return name, {attn: any(attrs.get(flag, False) for flag in flags)
                  for attn, flags in FLAGS.items()}


def check(model_type: str, kind: str, attn: str | None) -> None:
    """A one-line SpecError where the installed transformers' class refuses `attn`."""
    found = declared(model_type, kind) if attn in FLAGS else None
    if found is None:
        return
    name, allowed = found
    if not allowed[attn]:
        valid = sorted([a for a, ok in allowed.items() if ok] + ["eager"])
        flag = FLAGS[attn][0]
        raise SpecError("attn", attn, valid, reason=f"transformers' {model_type} code does not "
                        f"support it ({name}.{flag} is False in the installed transformers)")
