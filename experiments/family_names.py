"""Family names in shared code at a git revision (issue #35's count, docs/design.md "Families").

    python experiments/family_names.py REV [outside|common]

Counts string constants equal to a family's model_type (or its sub-config / tower type) and
`from transformers.models.<family> import ...` lines, docstrings left out, and the constants
inside a comparison (==, !=, in); `outside`: the package less `families/` (its registry
`__init__.py` counted), `common`: `families/common/` and the registry. The names are the
declared families' at the time of the redesign, fixed here so two revisions count alike.
"""
from __future__ import annotations

import ast
import subprocess
import sys

rev = sys.argv[1]
NAMES = {"llama","mistral","qwen2","qwen3","phi3","gemma2","gemma3_text","mixtral","qwen3_moe","gemma3","idefics3","smolvlm","internvl","llava","llava_next","llava_onevision","llava_next_video","mistral3","olmo2","qwen2_vl","qwen2_5_vl","qwen3_vl","qwen3_vl_moe","pixtral","qwen2_vl_text","qwen2_5_vl_text","qwen3_vl_text","qwen3_vl_moe_text"}
files = subprocess.run(["git","ls-tree","-r","--name-only",rev,"hybridmem"],capture_output=True,text=True).stdout.split()
folders = {"decoders","gemma3","idefics3","internvl","llava","mistral3","olmo2","qwen_vl","llava_next_video"}
SCOPE = sys.argv[2] if len(sys.argv) > 2 else "outside"
def shared(f):
    parts = f.split("/")
    if not f.endswith(".py"): return False
    if SCOPE == "outside": return parts[1] != "families" or parts[2] == "__init__.py"
    return parts[1] == "families" and parts[2] not in folders  # common/ and the registry
tot = cmp_ = 0; per = {}
for f in filter(shared, files):
    src = subprocess.run(["git","show",f"{rev}:{f}"],capture_output=True,text=True).stdout
    tree = ast.parse(src)
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n,(ast.Module,ast.FunctionDef,ast.ClassDef,ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0],ast.Expr) and isinstance(n.body[0].value,ast.Constant)}
    inc = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for c in ast.walk(n):
                if isinstance(c, ast.Constant) and c.value in NAMES: inc.add(id(c))
    for n in ast.walk(tree):
        mod = getattr(n, "module", None) if isinstance(n, ast.ImportFrom) else None
        if mod and mod.startswith("transformers.models.") and mod.split(".")[2] in NAMES:
            tot += 1; per[f] = per.get(f,0)+1
        if isinstance(n, ast.Constant) and isinstance(n.value,str) and n.value in NAMES and id(n) not in docs:
            tot += 1; per[f] = per.get(f,0)+1
            cmp_ += id(n) in inc
print(f"{rev}: family names in shared code {tot}, in comparisons {cmp_}")
for f,c in sorted(per.items(), key=lambda x:-x[1]): print(f"  {c:3d} {f}")
