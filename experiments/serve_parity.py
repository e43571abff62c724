"""The API's answer against `hybridmem predict --json` for varied jobs (not part of the suite;
tests/test_serve.py checks three): prints, per job, whether the two objects are equal.

The API runs in-process (FastAPI's TestClient) with a real trace pool of worker processes, so
the trace-tier job goes through it; the CLI runs in-process too. A launcher config is sent as
text to the API and as a file to the CLI: their `sources` and `warnings` name it differently
(`config.yaml` against the file's path), so the path is cut before comparing, and so is the
trace's wall time in its notes.

    python experiments/serve_parity.py
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not whichever is installed

from hybridmem.cli import main as cli_main  # noqa: E402
from hybridmem.serve.app import Settings, create_app  # noqa: E402

YAML = """model_name_or_path: meta-llama/Llama-3.2-1B
stage: sft
finetuning_type: lora
lora_rank: 16
cutoff_len: 1024
per_device_train_batch_size: 4
gradient_acumulation_steps: 4
bf16: true
"""

# (name, API body, CLI flags)
JOBS: list[tuple[str, dict, list[str]]] = [
    ("readme", {"model": "llava-1.5-7b", "micro_batch": 8, "seq_len": 2048,
                "train": "llm+projector", "grad_ckpt": True, "precision": "bf16-master",
                "gpu": "h100-80gb"},
     "--model llava-1.5-7b --micro-batch 8 --seq-len 2048 --train llm+projector --grad-ckpt "
     "--precision bf16-master --gpu h100-80gb".split()),
    ("lora-zero3", {"model": "meta-llama/Llama-3.2-1B", "train": "lora",
                    "lora": {"r": 16, "alpha": 32.0}, "micro_batch": 2, "seq_len": 512,
                    "world_size": 2, "strategy": "zero3", "gpu": "rtx-4090"},
     "--model meta-llama/Llama-3.2-1B --train lora --lora-r 16 --lora-alpha 32 --micro-batch 2 "
     "--seq-len 512 --world-size 2 --strategy zero3 --gpu rtx-4090".split()),
    ("max-batch", {"model": "tiny-llava", "seq_len": 256, "gpu_mem": 1.0,
                   "find_max_batch": True},
     "--model tiny-llava --seq-len 256 --gpu-mem 1 --find-max-batch".split()),
    ("qlora", {"model": "qwen2.5-7b", "train": "lora", "quantize": "nf4", "micro_batch": 2,
               "seq_len": 1024, "grad_ckpt": True, "gpu": "rtx-4090"},
     "--model qwen2.5-7b --train lora --quantize nf4 --micro-batch 2 --seq-len 1024 "
     "--grad-ckpt --gpu rtx-4090".split()),
    ("fsdp", {"model": "llama-3.2-1b", "world_size": 4, "strategy": "fsdp",
              "precision": "bf16-mixed", "micro_batch": 4, "seq_len": 1024, "gpu": "a100-40gb"},
     "--model llama-3.2-1b --world-size 4 --strategy fsdp --precision bf16-mixed "
     "--micro-batch 4 --seq-len 1024 --gpu a100-40gb".split()),
    ("8bit-adam", {"model": "mistral-7b-v0.3", "train": "lora", "optimizer": "adamw-8bit",
                   "lora_targets": ["q_proj", "v_proj"], "seq_len": 1024, "gpu": "l40s"},
     "--model mistral-7b-v0.3 --train lora --optimizer adamw-8bit --lora-targets q_proj,v_proj "
     "--seq-len 1024 --gpu l40s".split()),
    ("savers", {"model": "llama-3.2-1b", "grad_ckpt": True, "packing": True, "liger": True,
                "micro_batch": 4, "seq_len": 2048, "gpu": "rtx-3090"},
     "--model llama-3.2-1b --grad-ckpt --packing --liger --micro-batch 4 --seq-len 2048 "
     "--gpu rtx-3090".split()),
    ("gemma2-eager", {"model": "gemma-2-9b", "train": "lora", "attn": "eager", "seq_len": 1024,
                      "grad_ckpt": True, "gpu": "a100-80gb"},
     "--model gemma-2-9b --train lora --attn eager --seq-len 1024 --grad-ckpt "
     "--gpu a100-80gb".split()),
    ("trace", {"model": "tiny-llava", "seq_len": 128, "method": "trace", "gpu": "t4"},
     "--model tiny-llava --seq-len 128 --method trace --gpu t4".split()),
    ("llamafactory-yaml", {"config": YAML, "gpu": "rtx-4090"}, ["--gpu", "rtx-4090"]),
]


def cli_json(flags: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(["predict", *flags, "--json"])
    if code != 0:
        raise SystemExit(f"hybridmem predict {' '.join(flags)}: exit {code}")
    return json.loads(out.getvalue())


def _plain(answer: dict, path: str) -> dict:
    """The answer with the config file's path as the API names it and the trace's wall time
    (a note: "2 iterations on meta tensors in 8.4 s") cut."""
    text = json.dumps(answer).replace(path, "config.yaml")
    return json.loads(re.sub(r" in [0-9.]+ s\b", " in N s", text))


def same(api: dict, cli: dict, path: str) -> bool:
    return _plain(api, path) == _plain(cli, path)


def main() -> int:
    results = []
    with tempfile.TemporaryDirectory() as tmp, \
            TestClient(create_app(Settings(workers=0, workdir=Path(tmp) / "serve"))) as client:
        config = Path(tmp) / "config.yaml"
        config.write_text(YAML)
        for name, body, flags in JOBS:
            if "config" in body:
                flags = ["--config", str(config), *flags]
            api = client.post("/v1/predict", json=body)
            cli = cli_json(flags)
            equal = api.status_code == 200 and same(api.json(), cli, str(config))
            results.append(equal)
            print(f"{name:18s} {api.status_code} {cli['method']:14s} "
                  f"peak {cli['peak']['device_bytes'] / 2**30:7.2f} GiB  fit {cli['fit']!s:11s}"
                  f" {'equal' if equal else 'DIFFERENT'}")
    print(f"{sum(results)}/{len(results)} equal")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
