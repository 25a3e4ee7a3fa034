"""The bubblewrap command line of one sandboxed run, and the in-sandbox launcher that applies the limits.

What the program inside sees (docs/architecture.md, "Code sandbox"):
- its own network namespace with only a downed loopback (no network at all), and its own PID, IPC, UTS and
  cgroup namespaces: it sees its own processes only, and when the namespace's first process dies the kernel
  kills every other one, so a timed-out run leaves nothing behind;
- a fresh root: `/usr` (plus the `/bin`, `/lib*` links), a few `/etc` files the dynamic linker reads, the Python
  runtime's folders, all read-only; `/sandbox` (the run's scratch folder, its working directory) and a
  size-capped `/tmp`, writable; minimal `/dev` and `/proc`. Nothing else of the host exists there (no `/root`,
  no `/home`, no repository, no `runs/`), the environment is cleared, and the root itself is re-mounted read-only;
- an unprivileged identity. Started as root, bubblewrap sets the sandbox up with its own privileges and the
  launcher then drops to a per-worker-slot uid (`uid_base + slot`), with no capabilities and no_new_privs, so
  the process-count limit counts that one run's processes and `/proc/sys` stays closed (as host root in a user
  namespace it would not be). Started as another user, bubblewrap makes a user namespace (`--unshare-user`,
  further user namespaces disabled) and the program keeps that user's host identity.
The launcher (`LAUNCHER`, run by the runtime's python with `-S`) sets the resource limits, then execs the
program: limits set inside are the program's whole allowance, and nothing of the server runs after them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

SANDBOX_DIR = "/sandbox"  # the run's scratch folder and working directory, as the program sees it
PRIVILEGED, USERNS = "privileged", "userns"

# Read-only system folders; /bin, /sbin, /lib* are symlinks into /usr on merged-/usr systems and binds otherwise.
_SYSTEM_DIRS = ("/usr",)
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")

# argv: uid (-1: keep), processes, address-space bytes, cpu seconds, file-size bytes, open files, then "--" and the
# program's argv. Kept to stdlib calls with -S: it runs before the limits and must not import site-packages.
LAUNCHER = """\
import os, resource as r, sys
uid, nproc, mem, cpu, fsize, nofile = (int(v) for v in sys.argv[1:7])
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
for which, soft, hard in ((r.RLIMIT_NPROC, nproc, nproc), (r.RLIMIT_AS, mem, mem), (r.RLIMIT_DATA, mem, mem),
                          (r.RLIMIT_CPU, cpu, cpu + 1), (r.RLIMIT_FSIZE, fsize, fsize),
                          (r.RLIMIT_NOFILE, nofile, nofile), (r.RLIMIT_CORE, 0, 0)):
    r.setrlimit(which, (soft, hard))
os.execv(sys.argv[8], sys.argv[8:])
"""

# The program's environment: nothing of the server's. One BLAS/OpenMP thread each, since threads count against
# the process limit and a pool sized to the host's cores would hit it.
_PROGRAM_ENV = {
    "HOME": SANDBOX_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
}


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot build a sandbox here; the message says why and what to do."""


@dataclass(frozen=True)
class PythonRuntime:
    """An interpreter as the sandbox runs it: its path and the host folders it needs (bound read-only)."""

    executable: str
    folders: tuple[str, ...]


@dataclass(frozen=True)
class RunLimits:
    """Per-run resource limits, as the launcher applies them (rlimits: per process, except `processes`)."""

    processes: int  # RLIMIT_NPROC: processes and threads of the sandbox's uid
    memory_bytes: int  # RLIMIT_AS and RLIMIT_DATA of each process
    cpu_s: int  # RLIMIT_CPU of each process: SIGXCPU at this many seconds, SIGKILL one later
    file_size_bytes: int  # RLIMIT_FSIZE: the largest file a process may write
    open_files: int  # RLIMIT_NOFILE


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailableError("bubblewrap (bwrap) is not installed: `make setup` installs Debian's package as "
                                      "root, or run `apt-get install bubblewrap` (dnf/pacman: bubblewrap)")
    return path


def find_python_runtime(python: str) -> PythonRuntime:
    """Asks `python` where it lives: its venv (if any) and its installation, both to be bound read-only."""
    probe = ("import json, os, sys; print(json.dumps([os.path.abspath(sys.executable), sys.prefix, sys.base_prefix,"
             " os.path.realpath(sys.executable)]))")
    try:
        out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=30, check=True)
        executable, prefix, base_prefix, real_executable = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise SandboxUnavailableError(f"--python {python}: cannot run it to find its folders: {e}") from None
    home = os.path.dirname(os.path.dirname(real_executable))  # .../bin/python3.11 -> the installation
    folders: list[str] = []
    for folder in (prefix, base_prefix, os.path.realpath(prefix), os.path.realpath(base_prefix), home):
        if folder not in folders and not any(_inside(folder, d) for d in (*_SYSTEM_DIRS, *folders)):
            folders.append(folder)
    return PythonRuntime(executable=executable, folders=tuple(folders))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def build_command(*, bwrap: str, mode: str, runtime: PythonRuntime, scratch: str, program: Sequence[str],
                  limits: RunLimits, uid: int, tmp_bytes: int, info_fd: int) -> list[str]:
    """The argv of one run: bwrap, its namespaces and mounts, then the launcher and `program`.

    Args:
        mode: PRIVILEGED (bwrap runs as root; the launcher drops to `uid`) or USERNS (bwrap runs unprivileged).
        scratch: the host folder mounted read-write at /sandbox.
        program: the program's argv as the sandbox sees it (e.g. [python, "main.py"]).
        tmp_bytes: the size of the sandbox's /tmp (a tmpfs, memory-backed).
        info_fd: bwrap writes {"child-pid": host pid of the namespace's first process} to this fd.
    """
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--info-fd", str(info_fd)]
    if mode == USERNS:
        argv += ["--unshare-user", "--disable-userns"]
    elif mode == PRIVILEGED:
        # Only what the launcher needs to drop to `uid`; setuid to a non-zero uid clears them again.
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        raise ValueError(f"unknown sandbox mode {mode!r}; expected {PRIVILEGED!r} or {USERNS!r}")
    for folder in _SYSTEM_DIRS:
        argv += ["--ro-bind", folder, folder]
    for link in _SYSTEM_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    for path in _ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
             "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/dev/shm"]
    # After the tmpfs mounts, which would otherwise hide a runtime that lives under /tmp (a venv there).
    made: set[str] = {"/tmp", "/dev/shm"}
    for folder in runtime.folders:
        for parent in _parents(folder):
            if parent not in made and not any(_inside(parent, d) for d in (*_SYSTEM_DIRS, *_SYSTEM_LINKS)):
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        argv += ["--ro-bind", folder, folder]
    argv += ["--bind", scratch, SANDBOX_DIR, "--remount-ro", "/", "--chdir", SANDBOX_DIR, "--clearenv"]
    env = {"PATH": ":".join([os.path.dirname(program[0]), "/usr/local/bin", "/usr/bin", "/bin"]), **_PROGRAM_ENV}
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += ["--", runtime.executable, "-I", "-S", "-c", LAUNCHER,
             str(uid if mode == PRIVILEGED else -1), str(limits.processes), str(limits.memory_bytes),
             str(limits.cpu_s), str(limits.file_size_bytes), str(limits.open_files), "--", *program]
    return argv
