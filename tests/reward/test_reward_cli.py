"""`rlfabric reward score`: offline JSONL scoring through the real CLI."""

import json
import subprocess
import sys


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "services.cli", "reward", "score", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_score_jsonl_keeps_order_adds_score_and_summarises(tmp_path, repo_root, raw_responses):
    records = [{"id": i, "response": r["response"], "ground_truth": r["ground_truth"], "verdict": r["score"]}
               for i, r in enumerate(raw_responses[:40])]
    records.append({"id": "nobox", "response": "I think it is 7", "ground_truth": "7"})
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_cli("--verifier", "math_equiv", str(source), "--out", str(out), "--processes", "1", cwd=repo_root)
    assert result.returncode == 0, result.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in scored] == [r["id"] for r in records]  # input order
    for before, after in zip(records, scored, strict=True):
        assert {k: v for k, v in after.items() if k != "score"} == before  # the record comes back intact
    assert scored[-1]["score"] == 0.0 and "error" not in scored[-1]  # no answer is a verdict, not an error
    # The raw data's own grader agrees with math_equiv on these 40 responses.
    assert [r["score"] for r in scored[:40]] == [1.0 if r["verdict"] else 0.0 for r in records[:40]]
    assert "scored 41 records" in result.stdout and "errors 0" in result.stdout and "scores/s" in result.stdout
    assert "41/41 scored" in result.stderr  # progress


def test_score_jsonl_reports_failures_per_record(tmp_path, repo_root, faulty_plugins):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"response": text, "ground_truth": "1"}) + "\n"
                              for text in ("fine", "nan", "fine", "inf")))
    result = run_cli("--verifier", "return_nan", "--verifier-plugin", f"return_nan={faulty_plugins['return_nan']}",
                     str(source), "--out", str(out), "--processes", "1", "--quiet", cwd=repo_root)
    assert result.returncode == 0, result.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["score"] for r in scored] == [1.0, 0.0, 1.0, 0.0]
    assert ["error" in r for r in scored] == [False, True, False, True]
    assert scored[1]["error"].startswith("non_finite:")
    assert "errors 2" in result.stdout


def test_score_jsonl_names_the_bad_line(tmp_path, repo_root):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"response": "x", "ground_truth": "1"}) + "\n" + json.dumps({"response": "x"}) + "\n")
    result = run_cli("--verifier", "math_equiv", str(source), "--out", str(tmp_path / "out.jsonl"), "--processes", "1",
                     cwd=repo_root)
    assert result.returncode == 2
    assert "in.jsonl:2: field 'ground_truth' must be a string" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out.jsonl").exists()


def test_register_list_unregister_commands(reward_worker, repo_root, tmp_path):
    def reward(*args, token="s3cret"):
        env_token = []
        if token:
            token_file = tmp_path / f"token-{token}"
            token_file.write_text(token)
            token_file.chmod(0o600)
            env_token = ["--auth-token-file", str(token_file)]
        return subprocess.run([sys.executable, "-m", "services.cli", "reward", *args[:1], "--worker",
                               reward_worker.server.address, *env_token, *args[1:]], cwd=repo_root,
                              capture_output=True, text=True, timeout=120)

    denied = reward("register", "--name", "cli_rule", "--endpoint", "127.0.0.1:9", token="wrong")
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    done = reward("register", "--name", "cli_rule", "--endpoint", "127.0.0.1:9", "--version", "3",
                  "--description", "demo")
    assert done.returncode == 0 and "registered cli_rule v3 at 127.0.0.1:9" in done.stdout
    listed = reward("list", token=None)
    assert listed.returncode == 0
    assert any(line.startswith("cli_rule") and "127.0.0.1:9" in line for line in listed.stdout.splitlines())
    assert any(line.startswith("math_equiv") and "built-in" in line for line in listed.stdout.splitlines())
    assert reward("unregister", "--name", "cli_rule").returncode == 0
    missing = reward("unregister", "--name", "cli_rule")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_score_with_a_registered_remote_verifier(tmp_path, repo_root, redis_url, external_verifier):
    from services.common.redis_store import connect
    from services.reward.verifier_store import RemoteVerifierEntry, VerifierStore

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"response": f"the total is {i}", "ground_truth": "3"}) + "\n"
                              for i in range(5)))
    # Without Redis the CLI says how to reach a custom verifier (issue 12: it died with a traceback).
    result = run_cli("--verifier", "last_number", str(source), "--out", str(out), cwd=repo_root)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown verifier 'last_number'" in result.stderr and "--redis-url" in result.stderr
    assert "--verifier-plugin last_number=" in result.stderr and not out.exists()
    store = VerifierStore(connect(redis_url))
    store.register(RemoteVerifierEntry(name="last_number", version="7", endpoint=external_verifier))
    try:
        result = run_cli("--verifier", "last_number", "--redis-url", redis_url, str(source), "--out", str(out),
                         "--quiet", cwd=repo_root)
        assert result.returncode == 0, result.stderr
        assert [json.loads(line)["score"] for line in out.read_text().splitlines()] == [0.0, 0.0, 0.0, 1.0, 0.0]
        missing = run_cli("--verifier", "nobody", "--redis-url", redis_url, str(source), "--out", str(out), cwd=repo_root)
        assert missing.returncode == 2 and "no usable verifier 'nobody'" in missing.stderr
        assert "last_number" in missing.stderr  # what is registered
    finally:
        store.unregister("last_number")


def test_serve_refuses_bad_flags_with_a_message(repo_root):
    for flags, message in ((["--verifier-allow", "10.0.0.0/99"], "not a CIDR network"),
                           (["--deadline-s", "1e9"], "--deadline-s must be in (0, 3600]")):
        result = subprocess.run([sys.executable, "-m", "services.cli", "reward", "serve", *flags], cwd=repo_root,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
