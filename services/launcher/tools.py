"""The tool side of a multi-turn run on one host: tool servers and, for a local sandbox URL, the code sandbox.

With `rl_config.multi_turn_enable`, `rlfabric up` and `rlfabric system up` start, besides the GRPO services:
- `rlfabric sandbox serve` for each distinct local `sandbox_fusion_url` of the tool YAML's code interpreters
  (host 127.0.0.1, localhost or ::1), on a free loopback port; the tool servers get a copy of the YAML,
  `RUN_DIR/tools/<name>.yaml`, whose URL points at it (path kept, e.g. `/run_code`). A free port rather than the
  YAML's own: two runs on one host (a test beside a demo beside `make up`) would both want 8080, and a server
  already there would get the run's code. A URL of another host (your own SandboxFusion) is used as written,
  and no sandbox is started for it;
- `tool_servers` tool servers, `rlfabric tools serve --tool-config <the YAML or its copy>`, registered in the
  run's Redis as service "tools" (the coordinator's ToolClient finds them there) with the run's service token,
  which guards `Tool.Call` (services/common/credentials.py).
Both are expendable (services/launcher/supervision.py): one that dies is restarted (a sandbox on its port, so
the URL stays right), and until one is back, the calls it would have answered come back as tool errors that the
model reads: the run goes on.
"""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from services.common.processes import ServiceProcess, ServiceStartError, tail

LOCAL_HOSTS = ("localhost",)
SANDBOX_KIND = "sandbox"  # a child process that does not register in Redis (tool servers: ServiceKind.TOOLS)


@dataclass(frozen=True)
class SandboxPlan:
    """One sandbox to start: the URL the YAML names and the loopback port it gets."""

    yaml_url: str
    port: int

    @property
    def url(self) -> str:
        """The YAML's URL with this sandbox's address (its path kept)."""
        parts = urlsplit(self.yaml_url)
        return urlunsplit(("http", f"127.0.0.1:{self.port}", parts.path or "/run_code", parts.query, ""))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class ToolPlan:
    """What a multi-turn run starts: the tool YAML the servers host (the user's, or the run's copy) and the
    sandboxes."""

    source: Path  # rl_config.tool_config_path, resolved
    tool_config: Path  # what `tools serve --tool-config` reads
    sandboxes: tuple[SandboxPlan, ...]


def is_local(url: str) -> bool:
    """Whether `url` names this host's loopback (so the run starts the sandbox it names)."""
    host = urlsplit(url).hostname or ""
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plan_tools(cfg: Any, run_dir: Path) -> ToolPlan | None:
    """The tool side of `cfg`'s run (None without multi_turn_enable), the YAML copy written under `run_dir/tools`.

    The YAML was checked when the config loaded (services/common/config/multi_turn.py); ConfigError otherwise.
    """
    import yaml

    from services.common.config.multi_turn import tool_config_file
    from services.common.config.tools import CodeInterpreterConfig, load_tool_config
    from services.common.net import free_port

    if not cfg.rl_config.multi_turn_enable:
        return None
    source = tool_config_file(cfg)
    assert source is not None  # multi_turn_rules refuses the config without it
    source = source.resolve()
    loaded = load_tool_config(source)
    ports: dict[str, int] = {}
    for entry in loaded.tools:
        config = entry.config
        if isinstance(config, CodeInterpreterConfig) and is_local(config.sandbox_fusion_url):
            base = urlunsplit(urlsplit(config.sandbox_fusion_url)._replace(path="", query="", fragment=""))
            if base not in ports:
                ports[base] = free_port()
    if not ports:
        return ToolPlan(source, source, ())
    raw = yaml.safe_load(source.read_text())
    sandboxes: dict[str, SandboxPlan] = {}
    for item in raw["tools"]:
        url = (item.get("config") or {}).get("sandbox_fusion_url")
        if isinstance(url, str) and is_local(url):
            base = urlunsplit(urlsplit(url)._replace(path="", query="", fragment=""))
            plan = SandboxPlan(url, ports[base])
            sandboxes.setdefault(base, plan)
            item["config"]["sandbox_fusion_url"] = plan.url
    copy = Path(run_dir).resolve() / "tools" / source.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# {source} as this run's tool servers host it: each local sandbox_fusion_url points at the sandbox "
              "the run started\n# (services/launcher/tools.py).\n")
    copy.write_text(header + yaml.safe_dump(raw, sort_keys=False))
    return ToolPlan(source, copy, tuple(sandboxes.values()))


def sandbox_args(plan: SandboxPlan) -> list[str]:
    """`rlfabric sandbox serve` on the plan's loopback port (the sandbox has no token: loopback only, as
    SandboxFusion; its isolation is per run, services/sandbox/)."""
    return ["sandbox", "serve", "--host", "127.0.0.1", "--port", str(plan.port)]


def tool_server_args(plan: ToolPlan, redis_args: list[str]) -> list[str]:
    """`rlfabric tools serve` of the plan's YAML, registered in the run's Redis (security flags come from the
    stack that spawns it)."""
    return ["tools", "serve", "--tool-config", str(plan.tool_config), *redis_args]


def start_sandboxes(plan: ToolPlan, logs_dir: Path, *, detached: bool) -> list[ServiceProcess]:
    """Starts one `sandbox-N` child per planned sandbox (not waited for: see `wait_sandboxes`)."""
    return [ServiceProcess(f"{SANDBOX_KIND}-{i}", sandbox_args(s), logs_dir / f"{SANDBOX_KIND}-{i}.log",
                           detached=detached).start() for i, s in enumerate(plan.sandboxes)]


def sandbox_health(base_url: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The sandbox's `GET /health` answer, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None


def wait_sandboxes(plan: ToolPlan, processes: list[ServiceProcess], timeout_s: float,
                   say: Any = None) -> None:
    """Blocks until every planned sandbox answers `/health`; ServiceStartError naming the one that does not
    (its exit and log when it died: a host without a working bubblewrap, for instance)."""
    deadline = time.monotonic() + timeout_s
    for sandbox, proc in zip(plan.sandboxes, processes, strict=True):
        while sandbox_health(sandbox.base_url) is None:
            proc.check()
            if time.monotonic() > deadline:
                raise ServiceStartError(f"{proc.name} at {sandbox.base_url} not answering /health after "
                                        f"{timeout_s:.0f}s; last lines of {proc.log_path}:\n{tail(proc.log_path)}")
            time.sleep(0.25)
        if say is not None:
            say(f"  {proc.name} ready ({sandbox.url}, for {sandbox.yaml_url})")
