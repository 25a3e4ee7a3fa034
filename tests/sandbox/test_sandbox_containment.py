"""Containment: each hostile program ends in a clear error status, and the service serves the next request.

The server (conftest.py) runs with: run_timeout up to 10 s, memory up to 1024 MB, 32 processes, 64 KiB of output per
stream, 8 MB per file, 32 MB of scratch.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

import pytest

from services.sandbox.isolation import find_python_runtime


def test_network_is_unreachable(client, sandbox_server):
    port = sandbox_server.server_address[1]
    # The server listens on the host's loopback; the sandbox has a loopback of its own, with nothing on it.
    body = client.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)")
    assert body["status"] == "Failed" and body["run_result"]["return_code"] == 1
    assert "ConnectionRefusedError: [Errno 111] Connection refused" in body["run_result"]["stderr"]
    body = client.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)")
    assert body["status"] == "Failed"
    assert "OSError: [Errno 101] Network is unreachable" in body["run_result"]["stderr"]
    body = client.run("import socket\nsocket.getaddrinfo('example.com', 80)")
    assert body["status"] == "Failed" and "socket.gaierror" in body["run_result"]["stderr"]
    client.assert_serving()


def test_writing_outside_the_scratch_folder_fails(client, tmp_path):
    target = tmp_path / "host_dir"
    target.mkdir()
    venv_file = Path(os.path.realpath(sys.prefix)) / "sandbox_was_here"
    cases = [
        # (path the program writes, the error it gets)
        ("/usr/lib/sandbox_was_here", "OSError: [Errno 30] Read-only file system"),
        (str(venv_file), "OSError: [Errno 30] Read-only file system"),  # the runtime's folders: read-only binds
        ("/sandbox_was_here", "OSError: [Errno 30] Read-only file system"),  # the sandbox's root
        (str(target / "x"), "FileNotFoundError"),  # a host folder: not there at all
    ]
    for path, error in cases:
        body = client.run(f"open({path!r}, 'w').write('x')")
        assert body["status"] == "Failed" and error in body["run_result"]["stderr"], (path, body)
    assert list(target.iterdir()) == [] and not venv_file.exists()
    # The scratch folder and /tmp are writable; the next run starts with an empty one.
    body = client.run("open('a.txt', 'w').write('x'); open('/tmp/b.txt', 'w').write('y'); print('ok')")
    assert body["status"] == "Success"
    body = client.run("import os; print(sorted(os.listdir('.')), sorted(os.listdir('/tmp')))")
    # A runtime that lives under /tmp (a venv there) is bound into the sandbox's /tmp, read-only; nothing else is.
    runtime = sorted({Path(p).parts[2] for p in (sys.prefix, os.path.realpath(sys.prefix))
                      if Path(p).parts[1:2] == ("tmp",)})
    assert body["run_result"]["stdout"] == f"['main.py'] {runtime}\n"
    client.assert_serving()


def test_host_secrets_are_not_visible(client, tmp_path, monkeypatch):
    secret_dir = tmp_path / f"secret-{secrets.token_hex(4)}"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text("s3cret")
    root_secret = Path("/root") / f".rlfabric-sandbox-test-{secrets.token_hex(4)}"
    try:
        root_secret.write_text("s3cret")
    except OSError:
        root_secret = None  # not root: /root stays out of the test, the /tmp secret still counts
    monkeypatch.setenv("RLFABRIC_SANDBOX_TEST_SECRET", "s3cret")  # in the server's environment from now on
    try:
        for path in [secret_dir / "secret.txt", *([root_secret] if root_secret else [])]:
            body = client.run(f"print(open({str(path)!r}).read())")
            assert body["status"] == "Failed", body
            assert "FileNotFoundError" in body["run_result"]["stderr"] and "s3cret" not in body["run_result"]["stdout"]
        body = client.run(
            "import json, os\nprint(json.dumps(sorted(os.listdir('/'))))\n"
            "print(json.dumps(os.listdir('/root') if os.path.isdir('/root') else []))\n"
            "print(sorted(os.environ))\nprint(open('/proc/1/environ', 'rb').read())")
        lines = body["run_result"]["stdout"].splitlines()
        # Beside the system folders, only the Python runtime's folders and their ancestors exist.
        runtime = find_python_runtime(sys.executable).folders
        assert set(json.loads(lines[0])) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "proc",
                                             "dev", "tmp", "sandbox"} | {p.split("/")[1] for p in runtime}
        assert set(json.loads(lines[1])) == {p.split("/")[2] for p in runtime if p.startswith("/root/")}
        assert "RLFABRIC_SANDBOX_TEST_SECRET" not in lines[2]
        # /proc/1 is bubblewrap's process: not readable by the program (privileged mode), and never the server's env.
        assert "s3cret" not in body["run_result"]["stdout"]
        body = client.run("open('/proc/sys/vm/drop_caches', 'w')")
        assert "PermissionError: [Errno 13] Permission denied" in body["run_result"]["stderr"]
        # The repository (runs/, models, configs): absent, or only the venv's folder when the venv lives in it.
        repo = Path(__file__).resolve().parents[2]
        body = client.run(f"import os\nprint(os.listdir({str(repo)!r}) if os.path.exists({str(repo)!r}) else [])")
        venv = Path(sys.prefix)
        assert body["run_result"]["stdout"] == (f"['{venv.name}']\n" if venv.parent == repo else "[]\n")
    finally:
        if root_secret:
            root_secret.unlink()
    client.assert_serving()


def test_process_limit_holds(client, leftover_processes):
    # Each child sleeps, so they all exist at once; fork fails with EAGAIN at the limit (32, threads included).
    body = client.run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                      "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
                      "except OSError as e:\n    print(n, e.errno)\n", run_timeout=5)
    assert body["status"] == "Success", body
    children, errno = map(int, body["run_result"]["stdout"].split())
    assert errno == 11 and 20 <= children < 32  # the interpreter itself is one, bwrap's own may be another
    assert leftover_processes() == []  # the sleeping children went with the sandbox
    client.assert_serving()


def test_fork_bomb_is_killed_with_all_its_processes(client, leftover_processes):
    body = client.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                      run_timeout=2)
    assert body["status"] == "Failed" and body["run_result"]["status"] == "TimeLimitExceeded"
    assert body["run_result"]["return_code"] is None
    assert body["message"] == "run_timeout of 2 s exceeded: the program was killed"
    assert leftover_processes() == []
    client.assert_serving()


def test_memory_bomb_gets_memory_error(client):
    body = client.run("chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))", memory_limit_MB=128)
    assert body["status"] == "Failed" and body["run_result"]["return_code"] == 1
    assert body["run_result"]["stderr"].endswith("MemoryError\n")
    body = client.run("x = bytearray(2 << 30)", memory_limit_MB=-1)  # -1: the server's ceiling, 1024 MB
    assert body["run_result"]["stderr"].endswith("MemoryError\n")
    client.assert_serving()


def test_infinite_loop_is_stopped_at_run_timeout(client):
    body = client.run("print('started', flush=True)\nwhile True:\n    pass", run_timeout=1)
    result = body["run_result"]
    assert body["status"] == "Failed" and result["status"] == "TimeLimitExceeded" and result["return_code"] is None
    assert result["stdout"] == "started\n" and 1.0 <= result["execution_time"] < 3.0
    client.assert_serving()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_100_mb_of_output_is_truncated_and_killed(client, stream):
    body = client.run(f"import sys\nfor _ in range(100):\n    sys.{stream}.write('x' * (1 << 20))\n")
    result = body["run_result"]
    assert body["status"] == "Failed" and result["status"] == "Finished" and result["return_code"] == -9
    assert result[stream] == "x" * (64 << 10)  # exactly the limit
    assert body["message"] == (f"{stream} exceeded the output limit of 65536 bytes (--max-output-bytes): "
                               "truncated there, and the program was killed")
    client.assert_serving()


def test_disk_filling_is_stopped(client):
    body = client.run("open('big', 'wb').write(b'x' * (9 << 20))")  # one file over 8 MB
    assert body["status"] == "Failed" and "OSError: [Errno 27] File too large" in body["run_result"]["stderr"]
    body = client.run("for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20))", run_timeout=10)
    assert body["status"] == "Failed" and body["run_result"]["return_code"] == -9
    assert body["message"] == "the run's files exceeded 32 MB (--max-scratch-mb): the program was killed"
    body = client.run("for i in range(10):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (4 << 20))")  # a 32 MB tmpfs
    assert body["status"] == "Failed" and "No space left on device" in body["run_result"]["stderr"]
    client.assert_serving()
