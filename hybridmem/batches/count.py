"""Per-sample token counts of a local dataset under a local tokenizer: a file for `--lengths`.

    python -m hybridmem.batches.count --dataset data.jsonl --tokenizer ./tokenizer --out lengths.parquet

Users know their data, not "the" length of their job. This counts each sample as TRL's
SFTTrainer would feed it (its dataset formats, docs/source/sft_trainer.md): a conversational
sample (`messages`, or `prompt` + `completion` lists of messages) through the tokenizer's chat
template; a standard one (`text`, or `prompt` + `completion` strings) through the tokenizer,
with the EOS token appended where the text does not already end with it (TRL's SFT
preprocessing; not checked here against its code). A `--lengths` file keeps one mechanism for
every source of lengths. Nothing is downloaded: the dataset is a local JSONL / JSON / parquet /
CSV file (pandas) or a `datasets.save_to_disk` folder (needs `datasets`), the tokenizer a local
folder (`local_files_only`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hybridmem.errors import SpecError

FORMATS = ("messages", "prompt+completion", "text")
"""Sample layouts counted (TRL's dataset formats), looked for in this order."""


def load_tokenizer(path: str | os.PathLike):
    """A local tokenizer folder (tokenizer.json / tokenizer_config.json), never downloaded."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise SpecError("tokenizer", str(path), reason="not a local folder (nothing is downloaded)")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise SpecError("tokenizer", str(path), reason=f"cannot load it: "
                        f"{str(err).splitlines()[0][:120]}") from None


def load_records(path: str | os.PathLike) -> list[dict]:
    """The samples of a local dataset file or a `save_to_disk` folder, as dicts."""
    path = Path(path)
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            datasets = None
        # a checkout's own datasets/ folder imports as a namespace package without the library
        if not hasattr(datasets, "load_from_disk"):
            raise SpecError("dataset", str(path), reason="a saved dataset folder needs the "
                            "`datasets` package (pip install datasets), or give a JSONL / "
                            "parquet / CSV file")
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise SpecError("dataset", str(path), tuple(data), reason="has no train split")
            data = data["train"]
        return list(data)
    from hybridmem.batches.read import TABLES, read_table

    kind = TABLES.get(path.suffix.lower())
    if not path.is_file() or kind is None:
        raise SpecError("dataset", str(path), tuple(TABLES),
                        reason="not a dataset folder or a table file with one of these suffixes")
    try:
        return read_table(path, kind).to_dict("records")
    except SpecError as err:
        raise SpecError("dataset", str(path), reason=err.reason) from None


def _ids(encoded) -> list:
    """`apply_chat_template(tokenize=True)` returns a list, or a BatchEncoding in transformers 5."""
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def _with_eos(text: str, tok) -> str:
    eos = tok.eos_token
    return text if not eos or text.endswith(eos) else text + eos


def count_sample(sample: dict, tok) -> int:
    """Tokens of one sample in the first of `FORMATS` it has."""
    if isinstance(sample.get("messages"), (list, np.ndarray)):
        return len(_ids(tok.apply_chat_template(list(sample["messages"]), tokenize=True)))
    prompt, completion = sample.get("prompt"), sample.get("completion")
    if isinstance(prompt, (list, np.ndarray)) and isinstance(completion, (list, np.ndarray)):
        return len(_ids(tok.apply_chat_template([*prompt, *completion], tokenize=True)))
    if isinstance(prompt, str) and isinstance(completion, str):
        return (len(tok(prompt)["input_ids"])
                + len(tok(_with_eos(completion, tok), add_special_tokens=False)["input_ids"]))
    if isinstance(sample.get("text"), str):
        return len(tok(_with_eos(sample["text"], tok))["input_ids"])
    raise SpecError("dataset", str(sorted(sample)[:8]), FORMATS,
                    reason="a sample has none of these layouts")


def count(records: Iterable[dict], tok) -> np.ndarray:
    """Each sample's token count (`count_sample`)."""
    return np.array([count_sample(r, tok) for r in records], dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, help="local JSONL/JSON/parquet/CSV file or save_to_disk folder")
    ap.add_argument("--tokenizer", required=True, help="local tokenizer folder (with its chat template)")
    ap.add_argument("--out", required=True, help="parquet file with a `length` column, for --lengths")
    args = ap.parse_args(argv)
    try:
        lengths = count(load_records(args.dataset), load_tokenizer(args.tokenizer))
    except SpecError as err:
        print(f"error: {err}")
        return 2
    pd.DataFrame({"length": lengths}).to_parquet(args.out, index=False)
    print(f"{len(lengths)} samples, tokens p50 {int(np.median(lengths))} max {int(lengths.max())}"
          f" -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
