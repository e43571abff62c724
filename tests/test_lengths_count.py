"""Token counts of a local dataset under a local tokenizer (`hybridmem.batches.count`).

The tokenizer is built here (a word-level vocabulary, `<eos>` special, a chat template that
writes `<role> content <eos>` per message), so every expected count is a hand count of words.
"""

from __future__ import annotations

import json

import pytest

from hybridmem.batches.count import count, load_records, load_tokenizer, main
from hybridmem.batches.read import read_lengths
from hybridmem.errors import SpecError

TEMPLATE = "{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' <eos> ' }}{% endfor %}"


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", "hello", "world", "<user>",
                                         "<assistant>"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]")
    tok.chat_template = TEMPLATE
    out = tmp_path / "tok"
    tok.save_pretrained(out)
    return out


SAMPLES = [
    # <user> hello <eos> <assistant> world world <eos>: 7
    {"messages": [{"role": "user", "content": "hello"},
                  {"role": "assistant", "content": "world world"}]},
    # hello world + appended <eos>: 3
    {"text": "hello world"},
    # already ends with <eos>: nothing appended, 2
    {"text": "hello<eos>"},
    # prompt "hello" 1 + completion "world world" + <eos> 3
    {"prompt": "hello", "completion": "world world"},
]
EXPECTED = [7, 3, 2, 4]


def test_each_format_counts_as_the_hand_count(tokenizer_dir):
    assert count(SAMPLES, load_tokenizer(tokenizer_dir)).tolist() == EXPECTED


def test_a_jsonl_file_becomes_a_lengths_file(tokenizer_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in SAMPLES))
    out = tmp_path / "lengths.parquet"
    assert main(["--dataset", str(data), "--tokenizer", str(tokenizer_dir), "--out", str(out)]) == 0
    assert read_lengths(out).tokens.tolist() == EXPECTED


def test_bad_inputs_are_one_line_errors(tokenizer_dir, tmp_path):
    with pytest.raises(SpecError, match="tokenizer"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(SpecError, match="dataset"):
        load_records(tmp_path / "data.txt")
    with pytest.raises(SpecError, match="messages"):
        count([{"other": 1}], load_tokenizer(tokenizer_dir))


def test_a_saved_dataset_folder(tokenizer_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    if not hasattr(datasets, "Dataset"):
        pytest.skip("the `datasets` library is not installed (a checkout folder shadows it)")
    datasets.Dataset.from_list([{"text": "hello world"}]).save_to_disk(str(tmp_path / "saved"))
    assert count(load_records(tmp_path / "saved"), load_tokenizer(tokenizer_dir)).tolist() == [3]


def test_a_saved_dataset_folder_without_the_library_says_what_it_needs(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(SpecError, match="pip install datasets"):
        load_records(tmp_path)
