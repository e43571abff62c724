"""No input file of any content gives a traceback (issue 37): every option that names a file,
fed binary, deeply nested, huge and empty content, answers one line and exit code 2; the
service answers the same bodies with a 422 line (413 past its size cap), never a 500.

The deep documents are 100,000 brackets: far past Python's recursion limit (1000 frames), which
`json` and PyYAML would otherwise hit (`RecursionError`)."""

from __future__ import annotations

import pytest

from hybridmem.cli import main

DEEP = 100_000
CONTENTS = {
    "binary": bytes(range(256)) * 64,
    "deep-array": ("[" * DEEP + "]" * DEEP).encode(),
    "deep-object": ('{"a":' * DEEP + "1" + "}" * DEEP).encode(),
    "deep-yaml": ("a:\n" + "".join("  " * i + "- \n" for i in range(1, 200))
                  + "a: " + "[" * DEEP + "]" * DEEP).encode(),
    "huge": b'{"x": [' + b",".join([b"1"] * 2_000_000) + b"]}",
    "empty": b"",
}
# the option, and what else the command needs for that file to be read
OPTIONS = {
    "--model": [],
    "--peft-config": ["--model", "tiny-llama"],
    "--quantization-config": ["--model", "tiny-llama", "--train", "lora"],
    "--training-args": ["--model", "tiny-llama"],
    "--deepspeed": ["--model", "tiny-llama"],
    "--config": ["--model", "tiny-llama"],
}


def _run(capsys, args: list[str]) -> tuple[int, str, str]:
    try:
        rc = main(["predict", *args])
    except SystemExit as err:  # typer's own usage errors
        rc = err.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# (option, file suffix): --config reads YAML, torchtitan TOML and Megatron-LM launch scripts by
# suffix (`intake.dialects`)
FILES = [(option, ".json") for option in OPTIONS] + [("--config", ".toml"), ("--config", ".sh")]


@pytest.mark.parametrize("option, suffix", FILES)
@pytest.mark.parametrize("kind", CONTENTS)
def test_no_file_content_gives_a_traceback(option, suffix, kind, tmp_path, capsys):
    path = tmp_path / f"{kind}{suffix}"
    path.write_bytes(CONTENTS[kind])
    rc, out, err = _run(capsys, [*OPTIONS[option], option, str(path)])
    assert "Traceback" not in out + err
    if rc != 0:  # a huge or deep file the reader accepts may price a job; a refusal is 2
        assert rc == 2, (rc, err)
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert len(err) < 400, err  # one readable line, not the file echoed back


@pytest.mark.parametrize("kind", ["binary", "deep-array", "empty"])
def test_lengths_file_of_any_content_is_one_line(kind, tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_bytes(CONTENTS[kind])
    rc, out, err = _run(capsys, ["--model", "tiny-llama", "--lengths", str(path)])
    assert rc == 2 and "Traceback" not in out + err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from hybridmem.serve.app import Settings, create_app

    app = create_app(Settings(trace_workers=0, workdir=tmp_path_factory.mktemp("serve")))
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize("kind", CONTENTS)
def test_the_service_answers_every_body_with_one_line(client, kind):
    r = client.post("/v1/predict", content=CONTENTS[kind],
                    headers={"content-type": "application/json"})
    assert r.status_code in (413, 422), (r.status_code, r.text[:200])
    assert "\n" not in r.json()["detail"] and len(r.json()["detail"]) < 400


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("field, value", [
    ("training_args", {"a": _nested(80)}),  # past jsonfile.MAX_DEPTH inside the body
    ("config", "a: " + "[" * 5000 + "]" * 5000),  # YAML text: PyYAML recurses per level
    ("peft_config", "[" * DEEP + "]" * DEEP),  # the echo's JSON text form
], ids=["training_args", "config", "peft_config"])
def test_the_service_refuses_deep_inline_files(client, field, value):
    r = client.post("/v1/predict", json={"model": "tiny-llama", field: value})
    assert r.status_code == 422, (r.status_code, r.text[:200])
    assert "\n" not in r.json()["detail"]
