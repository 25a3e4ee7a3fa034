"""One `/run_code` request, run to its end under its limits: the sandbox's engine, no HTTP here.

Each run gets a fresh scratch folder (the request's `files`, then the code as `main.py`), a bubblewrap sandbox
(isolation.py) and a wall clock. The run ends, and its whole PID namespace with it, when:
- the program exits: status Finished with its return code (128 + N when it died of signal N, as bwrap reports it);
- `run_timeout` passes: TimeLimitExceeded, return code null, the output so far (SandboxFusion's semantics);
- stdout or stderr passes `max_output_bytes`: the stream is truncated there, the program killed (return code -9),
  and the message says which stream and the limit;
- the scratch folder grows past `max_scratch_mb` (checked 4 times a second): killed likewise, the message says so.
Stopping a run kills the namespace's first process, so the kernel kills every process in it, fork bombs
included, before the wait returns: the next run on the slot starts with no leftovers counted against it.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from services.sandbox import isolation, schema
from services.sandbox.isolation import SandboxUnavailableError

logger = logging.getLogger(__name__)

_READ_CHUNK = 64 * 1024
_SCRATCH_CHECK_S = 0.25
_SCRATCH_MAX_ENTRIES = 100_000  # a run that makes more files than this is stopped like one that writes too much
_START_TIMEOUT_S = 10.0  # bubblewrap's own set-up (mounts, namespaces): milliseconds normally
DEFAULT_RUN_TIMEOUT_S = 10.0  # SandboxFusion's default run_timeout


@dataclass(frozen=True)
class SandboxLimits:
    """The server's limits; a request may ask for less time or memory, never more (refused, naming the flag)."""

    max_run_timeout_s: float = 60.0
    max_memory_mb: int = 4096  # also the limit of a request that says memory_limit_MB = -1
    max_processes: int = 64
    max_output_bytes: int = 1 << 20  # per stream, as SandboxFusion's 1 MiB capture
    max_file_size_mb: int = 64
    max_scratch_mb: int = 256  # the scratch folder, and separately the sandbox's /tmp (memory-backed)
    max_open_files: int = 256

    def __post_init__(self) -> None:
        for name in ("max_run_timeout_s", "max_memory_mb", "max_processes", "max_output_bytes", "max_file_size_mb",
                     "max_scratch_mb", "max_open_files"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value!r}")


@dataclass(frozen=True)
class RunOutcome:
    response: dict  # the /run_code response body
    outcome: str  # for metrics: success, failed, timeout, output_limit, scratch_limit, sandbox_error
    slot_clean: bool = True  # False: a process of the run may have outlived it; the slot should not be reused


class Sandbox:
    """Runs requests in bubblewrap sandboxes; one instance per server, `run` called from many threads."""

    def __init__(self, limits: SandboxLimits, *, python: str = sys.executable, scratch_root: str | None = None,
                 uid_base: int = 2_000_000_000) -> None:
        self.limits = limits
        self.bwrap = isolation.find_bwrap()
        self.runtime = isolation.find_python_runtime(python)
        self.mode = isolation.PRIVILEGED if os.geteuid() == 0 else isolation.USERNS
        self.uid_base = uid_base
        self._root = tempfile.mkdtemp(prefix="rlfabric-sandbox-", dir=scratch_root)

    def describe(self) -> dict:
        return {"isolation": "bubblewrap", "mode": self.mode, "bwrap": self.bwrap, "python": self.runtime.executable,
                "runtime_folders": list(self.runtime.folders), "scratch_root": self._root}

    def check(self) -> None:
        """Runs one trivial program through the whole path; raises SandboxUnavailableError, with bwrap's words."""
        request = schema.RunCodeRequest(code="print('sandbox ok')", language="python",
                                         run_timeout=self.limits.max_run_timeout_s)
        result = self.run(request, slot=0)
        run_result = result.response["run_result"] or {}
        if result.outcome != "success" or run_result.get("stdout") != "sandbox ok\n":
            detail = result.response["message"] or run_result.get("stderr") or json.dumps(result.response)[:400]
            hint = (" (as root, bubblewrap needs the mount and namespace capabilities: a container may lack them; "
                    "run the server as a non-root user where user namespaces are allowed)"
                    if self.mode == isolation.PRIVILEGED else
                    " (as a non-root user, bubblewrap needs unprivileged user namespaces: "
                    "sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu an AppArmor profile for bwrap)")
            raise SandboxUnavailableError(f"bubblewrap cannot run a sandbox here in {self.mode} mode: "
                                          f"{detail.strip()[:400]}{hint}")

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)

    def run(self, request: schema.RunCodeRequest, slot: int) -> RunOutcome:
        refusal = self.refusal(request)
        if refusal:
            return RunOutcome(schema.sandbox_error(refusal), "sandbox_error")
        call_dir = tempfile.mkdtemp(dir=self._root)
        try:
            return self._run(request, slot, call_dir)
        except OSError as e:  # the host side failed (disk full, fd limit): the sandbox's error, not the program's
            logger.exception("sandbox run failed on the host side")
            return RunOutcome(schema.sandbox_error(f"the sandbox could not run the code: {e}"), "sandbox_error")
        finally:
            shutil.rmtree(call_dir, ignore_errors=True)

    def refusal(self, request: schema.RunCodeRequest) -> str:
        """Why this server will not run `request` (language, a limit over its own), or "" when it will."""
        if request.language not in schema.SUPPORTED_LANGUAGES:
            return (f"language {request.language!r} is not supported by this sandbox; it runs "
                    f"{', '.join(schema.SUPPORTED_LANGUAGES)}")
        if request.run_timeout is not None and request.run_timeout > self.limits.max_run_timeout_s:
            return (f"run_timeout {request.run_timeout:g} s is over this server's limit of "
                    f"{self.limits.max_run_timeout_s:g} s (--max-run-timeout-s)")
        if request.memory_limit_MB > self.limits.max_memory_mb:
            return (f"memory_limit_MB {request.memory_limit_MB} is over this server's limit of "
                    f"{self.limits.max_memory_mb} MB (--max-memory-mb)")
        return ""

    def run_timeout(self, request: schema.RunCodeRequest) -> float:
        """The request's run_timeout; one it did not send is SandboxFusion's 10 s, or this server's limit if lower."""
        if request.run_timeout is not None:
            return request.run_timeout
        return min(DEFAULT_RUN_TIMEOUT_S, self.limits.max_run_timeout_s)

    def _run_limits(self, request: schema.RunCodeRequest) -> isolation.RunLimits:
        memory_mb = self.limits.max_memory_mb if request.memory_limit_MB == -1 else request.memory_limit_MB
        # In a user namespace the namespace's first process (bwrap's) shares the program's uid and counts.
        processes = self.limits.max_processes + (1 if self.mode == isolation.USERNS else 0)
        return isolation.RunLimits(processes=processes, memory_bytes=memory_mb << 20,
                                   cpu_s=math.ceil(self.run_timeout(request)) + 1,
                                   file_size_bytes=self.limits.max_file_size_mb << 20,
                                   open_files=self.limits.max_open_files)

    def _run(self, request: schema.RunCodeRequest, slot: int, call_dir: str) -> RunOutcome:
        scratch = os.path.join(call_dir, "scratch")
        os.mkdir(scratch, 0o755)
        main = _write_inputs(scratch, request)
        uid = self.uid_base + slot
        if self.mode == isolation.PRIVILEGED:
            _chown_tree(scratch, uid)
        stdin_path = os.path.join(call_dir, "stdin")
        with open(stdin_path, "wb") as f:
            f.write((request.stdin or "").encode())
        info_r, info_w = os.pipe()
        argv = isolation.build_command(
            bwrap=self.bwrap, mode=self.mode, runtime=self.runtime, scratch=scratch,
            program=[self.runtime.executable, main], limits=self._run_limits(request), uid=uid,
            tmp_bytes=self.limits.max_scratch_mb << 20, info_fd=info_w)
        with open(stdin_path, "rb") as stdin:
            started = time.monotonic()
            try:
                # A minimal environment: bwrap's own processes (the namespace's first one among them) carry it.
                proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(info_w,), start_new_session=True,
                                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            except OSError:
                os.close(info_r)
                raise
            finally:
                os.close(info_w)
        watch = _RunWatch(proc, info_r, scratch, self.limits, started + self.run_timeout(request))
        try:
            watch.follow()
        finally:
            watch.stop()
        elapsed = time.monotonic() - started
        return self._outcome(request, watch, scratch, elapsed)

    def _outcome(self, request: schema.RunCodeRequest, watch: _RunWatch, scratch: str, elapsed: float) -> RunOutcome:
        stdout, stderr = (bytes(b).decode("utf-8", errors="replace") for b in watch.output)
        if watch.child_pid is None:  # bwrap failed before the program started
            message = f"the sandbox could not start: {stderr.strip()[:1000] or f'bwrap exited {watch.returncode}'}"
            return RunOutcome(schema.sandbox_error(message), "sandbox_error", watch.clean)
        files = _fetch_files(scratch, request.fetch_files)
        if watch.stopped == "timeout":
            result = schema.command_result(schema.TIME_LIMIT_EXCEEDED, execution_time=elapsed, stdout=stdout,
                                           stderr=stderr)
            message = f"run_timeout of {self.run_timeout(request):g} s exceeded: the program was killed"
            return RunOutcome(schema.run_code_response(run_result=result, message=message, files=files), "timeout",
                              watch.clean)
        return_code = -signal.SIGKILL if watch.stopped else watch.returncode
        result = schema.command_result(schema.FINISHED, execution_time=elapsed, return_code=return_code,
                                       stdout=stdout, stderr=stderr)
        if watch.stopped == "output_limit":
            message = (f"{watch.overflow} exceeded the output limit of {self.limits.max_output_bytes} bytes "
                       "(--max-output-bytes): truncated there, and the program was killed")
        elif watch.stopped == "scratch_limit":
            message = (f"the run's files exceeded {self.limits.max_scratch_mb} MB (--max-scratch-mb): "
                       "the program was killed")
        elif return_code == 128 + signal.SIGXCPU:
            message = f"killed by SIGXCPU: the CPU time limit of {math.ceil(self.run_timeout(request)) + 1} s"
        else:
            message = ""
        response = schema.run_code_response(run_result=result, message=message, files=files)
        outcome = watch.stopped or ("success" if response["status"] == schema.SUCCESS else "failed")
        return RunOutcome(response, outcome, watch.clean)


class _RunWatch:
    """Follows one started run: its info pipe, capped output, scratch size, deadline; stops it when due."""

    def __init__(self, proc: subprocess.Popen, info_fd: int, scratch: str, limits: SandboxLimits,
                 deadline: float) -> None:
        self.proc, self.scratch, self.limits, self.deadline = proc, scratch, limits, deadline
        self.output = (bytearray(), bytearray())
        self.child_pid: int | None = None
        self.stopped = ""  # "", timeout, output_limit, scratch_limit
        self.overflow = ""  # the stream that passed the output limit
        self.returncode: int | None = None
        self.clean = True
        self._info = bytearray()
        self._selector = selectors.DefaultSelector()
        self._fds = {proc.stdout.fileno(): 0, proc.stderr.fileno(): 1, info_fd: 2}  # type: ignore[union-attr]
        for fd in self._fds:
            self._selector.register(fd, selectors.EVENT_READ)
        self._info_fd = info_fd

    def follow(self) -> None:
        start_by = time.monotonic() + _START_TIMEOUT_S
        next_scratch_check = time.monotonic() + _SCRATCH_CHECK_S
        while self._selector.get_map():
            now = time.monotonic()
            if self.child_pid is None and self._info_fd in self._fds and now > start_by:
                self._stop("timeout")
                return
            if now >= self.deadline:
                self._stop("timeout")
                return
            if now >= next_scratch_check:
                next_scratch_check = now + _SCRATCH_CHECK_S
                if _tree_too_big(self.scratch, self.limits.max_scratch_mb << 20):
                    self._stop("scratch_limit")
                    return
            for key, _ in self._selector.select(min(self.deadline - now, _SCRATCH_CHECK_S)):
                if self._read(key.fd):
                    return
        # Both pipes closed: the namespace is gone, or the program closed them and lives on; the deadline holds.
        try:
            self.returncode = self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._stop("timeout")

    def _read(self, fd: int) -> bool:
        """Reads what is ready on `fd`; True when the run had to be stopped."""
        chunk = os.read(fd, _READ_CHUNK)
        stream = self._fds[fd]
        if not chunk:
            self._close(fd)
            return False
        if stream == 2:
            self._info += chunk
            try:
                self.child_pid = int(json.loads(self._info)["child-pid"])
                self._close(fd)
            except (ValueError, KeyError):
                pass  # not all of it yet
            return False
        buffer = self.output[stream]
        room = self.limits.max_output_bytes - len(buffer)
        buffer += chunk[:room]
        if len(chunk) > room:
            self.overflow = ("stdout", "stderr")[stream]
            self._stop("output_limit")
            return True
        return False

    def _close(self, fd: int) -> None:
        self._selector.unregister(fd)
        del self._fds[fd]
        if fd == self._info_fd:
            os.close(fd)

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        # The namespace's first process: when it dies the kernel kills the rest, and bwrap, its parent, exits only
        # after that; its own process group is the fallback when bwrap never got as far as making it.
        target = self.child_pid
        try:
            if target is not None:
                os.kill(target, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.returncode = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.returncode = self.proc.wait()
            self.clean = False
            logger.error("sandbox pid %s outlived its kill for 10 s; its slot is retired", target)

    def stop(self) -> None:
        """Releases the pipes; the process is waited for (already, unless an exception got here first)."""
        if self.proc.poll() is None:
            self._stop(self.stopped or "timeout")
        for fd in list(self._fds):
            self._close(fd)
        self._selector.close()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc.stderr.close()  # type: ignore[union-attr]


def _write_inputs(scratch: str, request: schema.RunCodeRequest) -> str:
    """Writes `files` then the code; returns the code's path as the sandbox sees it."""
    for path, content in request.files.items():
        target = os.path.join(scratch, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(content)
    name, n = "main.py", 0
    while name in request.files:  # a request's own main.py stays as sent, as upstream's code file never clashes
        n += 1
        name = f"main_{n}.py"
    with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
        f.write(request.code)
    return f"{isolation.SANDBOX_DIR}/{name}"


def _chown_tree(root: str, uid: int) -> None:
    os.chown(root, uid, uid)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(folder, name), uid, uid, follow_symlinks=False)


def _tree_too_big(root: str, limit: int) -> bool:
    total, entries, stack = 0, 0, [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                    if total > limit or entries > _SCRATCH_MAX_ENTRIES:
                        return True
        except OSError:  # removed while walking
            continue
    return False


def _fetch_files(scratch: str, paths: tuple[str, ...]) -> dict[str, str]:
    """The requested files, base64; a path that is missing, not a regular file or leads out via a link is left out
    (as upstream leaves out a missing one). The run's processes are all dead by now, so nothing moves under us."""
    real_scratch = os.path.realpath(scratch)
    files: dict[str, str] = {}
    for path in paths:
        target = os.path.realpath(os.path.join(scratch, path))
        if not target.startswith(real_scratch + os.sep) or not os.path.isfile(target):
            continue
        with open(target, "rb") as f:
            files[path] = base64.b64encode(f.read()).decode("ascii")
    return files

