"""`rlfabric tools ...` through the real CLI: the two servers as processes, a call, and clear refusals."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from services.cli import main
from tests.tools.conftest import write_tool_yaml


def _spawn(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "tools", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"{args[0]} did not start: {proc.stderr.read()}")
    return proc, line.strip()


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=15)


@pytest.mark.slow  # two service processes (about 4 s of imports)
def test_serve_both_servers_and_call(tmp_path, corpus_path, capsys):
    retrieval, line = _spawn("retrieval-serve", "--corpus", str(corpus_path), "--port", "0")
    try:
        assert line.startswith("retrieval server listening on http://127.0.0.1:") and line.endswith("(4 documents)")
        url = line.split()[4]
        yaml_path = write_tool_yaml(tmp_path / "search.yaml", retrieval_url=url)
        tools, line = _spawn("serve", "--tool-config", str(yaml_path), "--insecure", "--metrics-port", "0")
        try:
            assert line.endswith("tools search"), line
            endpoint = line.split()[5]
            assert main(["tools", "list", "--server", endpoint]) == 0
            assert capsys.readouterr().out.startswith("search ")
            code = main(["tools", "call", "--server", endpoint, "--name", "search", "--arguments",
                         json.dumps({"query_list": ["Paris"]})])
            out = capsys.readouterr()
            assert code == 0 and out.err.startswith("OK in ")
            # topk 3 (the YAML's); two documents hold "paris", the one holding it twice first
            assert json.loads(out.out) == {"result": "Doc 1 (Title: \"Paris\")\nParis is the capital and largest "
                                                     "city of France.\n\nDoc 2 (Title: \"Seine\")\nThe Seine flows "
                                                     "through Paris to the English Channel."}
        finally:
            assert _stop(tools) == 0
    finally:
        assert _stop(retrieval) == 0


def test_bad_tool_yaml_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "t.yaml"
    bad.write_text("tools:\n  - class_name: mindspeed_rl.tools.retool.Nope\n    config: {}\n")
    assert main(["tools", "serve", "--tool-config", str(bad), "--insecure"]) == 2
    err = capsys.readouterr().err
    assert "tools[0].class_name: 'mindspeed_rl.tools.retool.Nope' is not a tool rlfabric hosts" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--corpus", "missing.jsonl"], "corpus missing.jsonl: not found"),
    (["--corpus", "CORPUS", "--topk", "0"], "--topk must be in 1..1000, got 0"),
])
def test_retrieval_serve_refusals(corpus_path, capsys, args, message):
    args = [str(corpus_path) if a == "CORPUS" else a for a in args]
    assert main(["tools", "retrieval-serve", *args, "--port", "0"]) == 2
    assert message in capsys.readouterr().err
