"""Multi-turn tool use through the real CLI: `rlfabric up configs/grpo_multi_turn_demo_cpu.yaml` starts Redis, a
reward worker, a vLLM replica, Megatron actor and reference trainers, the coordinator, and, for the tool YAML
(configs/tools/retool_tiny.yaml, a ReTool code interpreter with a local sandbox_fusion_url), a code sandbox
(`rlfabric sandbox serve`, bubblewrap) and a tool server (`rlfabric tools serve`). The task is the multi-turn
demo's, "What is A*B?" (A, B in 317..999), which a tiny Qwen2 solves only by calling the code interpreter
(examples/multi_turn/tool_task.py).

- CI (`test_tool_calls_run_through_up_and_a_killed_sandbox_costs_no_run`): a quick warm-up that teaches the frame
  of the call and the answer but not the digits (~60 steps of 16), then 5 small iterations: the model's calls are
  parsed, run in the sandbox and answered (tool calls per sample and success rate above 0, tool tokens in the
  responses), and the sandbox, SIGKILLed after the first iteration, is restarted by `up` on its port while the
  run goes on to DONE, the calls of every iteration that starts once it serves again succeeding (at lr 0, so that
  the updates cannot unlearn the call format the warm-up taught).
- Slow (`make soak`): from the demo's warm-up (the tool path right on ~80% of the problems, a call on ~64% of the
  samples, a quarter of them malformed), GRPO raises the reward, the tool calls per sample and the tool success
  rate by the demo's marks (examples/multi_turn/report.py); and a sandbox killed
  until `up` gives up on it, and a tool server killed once, cost their samples tool errors, not the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from services.report.run_metrics import find_metrics, read_metrics
from tests.console import ConsoleProcess

CONFIG = "configs/grpo_multi_turn_demo_cpu.yaml"
# 4 prompts x 4 samples per iteration (the demo's: 8 x 8), one update.
SMALL = ("-o", "megatron_training.global_batch_size=4", "-o", "rl_config.n_samples_per_prompt=4",
         "-o", "rl_config.mini_batch_size=4", "-o", "actor_config.micro_batch_size=16",
         "-o", "rl_config.actor_forward_micro_batch_size=16", "-o", "rl_config.ref_forward_micro_batch_size=16")
TOOL_KEYS = ("tool/calls_per_sample", "tool/turns_per_sample", "tool/success_rate", "tool/errors", "tool/timeouts",
             "tool/latency_s_mean", "response_length/generated_mean", "response_length/tool_mean")


def tool_task(repo_root: Path) -> ModuleType:
    """examples/multi_turn/tool_task.py (the demo's task and warm-up), imported from its file."""
    return demo_module(repo_root, "tool_task")


def demo_module(repo_root: Path, stem: str) -> ModuleType:
    """examples/multi_turn/{stem}.py, imported from its file."""
    name = f"examples_multi_turn_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, repo_root / "examples" / "multi_turn" / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def format_warmup(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """The demo's files with a quick warm-up (~110 steps of 16 on the tool path alone, ~70 CPU s): sampling writes
    the frame of a call and an answer right about 70% of the time, the digits not yet; the call on most problems."""
    import torch

    torch.set_num_threads(1)
    task = tool_task(repo_root)
    settings = task.WarmupSettings(batch_size=16, stop_on="frame", stop_at=0.7, check_every=10, check_rows=64,
                                   steps=300, mixed_steps=0)
    return task.prepare(tmp_path_factory.mktemp("multi_turn_format"), settings, train=1000, held_out=64)


@pytest.fixture(scope="session")
def tool_warmup(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """The demo's files and warm-up (examples/multi_turn/tool_task.py defaults)."""
    import torch

    torch.set_num_threads(1)
    return tool_task(repo_root).prepare(tmp_path_factory.mktemp("multi_turn"))


class Up(ConsoleProcess):
    """`rlfabric up` on the multi-turn demo config from a warm-up folder, its output followed."""

    def __init__(self, repo_root: Path, work: Path, run_dir: Path, *extra: str) -> None:
        super().__init__("up", [
            sys.executable, "-m", "services.cli", "up", CONFIG,
            "-o", f"megatron_training.tokenizer_name_or_path={work / 'sft_model'}",
            "-o", f"megatron_training.data_path={work / 'dataset' / 'train'}",
            "-o", f"actor_config.load={work / 'sft_model'}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "--run-dir", str(run_dir), *extra], repo_root)

    def child(self, needle: str) -> int:
        """The pid of the live child of `up` whose command line holds `needle`."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        found = [int(p) for p in children
                 if needle in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")]
        assert len(found) == 1, (needle, found)
        return found[0]

    def finish(self, timeout_s: float = 1800) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        time.sleep(0.5)  # the reader thread drains the pipe
        return rc

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except Exception:  # noqa: BLE001 - a hung `up` is killed; its reaper ends the children
                self.proc.kill()


def wait_until_healthy(url: str, timeout_s: float) -> None:
    """Polls `url` (a sandbox's /health) until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer within {timeout_s:.0f} s"
        time.sleep(0.2)


def metrics(run_dir: Path) -> list[dict[str, float]]:
    return read_metrics(find_metrics(run_dir))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_a_local_sandbox_url_gets_the_runs_sandbox_and_another_host_is_used_as_written(repo_root: Path,
                                                                                       tmp_path: Path) -> None:
    import yaml

    from services.common.config import load_config
    from services.common.config.tools import load_tool_config
    from services.launcher.tools import plan_tools

    def plan(tool_yaml: Path):
        cfg = load_config(repo_root / CONFIG, [f"rl_config.tool_config_path={tool_yaml}"])
        return plan_tools(cfg, tmp_path / "run")

    source = repo_root / "configs" / "tools" / "retool_tiny.yaml"
    local = plan(source)
    assert local.source == source and local.tool_config == tmp_path / "run" / "tools" / "retool_tiny.yaml"
    (sandbox,) = local.sandboxes
    assert sandbox.yaml_url == "http://localhost:8080/run_code" and 1024 < sandbox.port < 65536
    copied, original = load_tool_config(local.tool_config).tools[0], load_tool_config(source).tools[0]
    assert copied.config.sandbox_fusion_url == f"http://127.0.0.1:{sandbox.port}/run_code"
    assert copied.schema == original.schema and copied.config.num_workers == original.config.num_workers

    raw = yaml.safe_load(source.read_text())
    raw["tools"][0]["config"]["sandbox_fusion_url"] = "http://sandbox.example:8080/run_code"
    (tmp_path / "remote.yaml").write_text(yaml.safe_dump(raw))
    remote = plan(tmp_path / "remote.yaml")
    assert remote.tool_config == remote.source == tmp_path / "remote.yaml" and remote.sandboxes == ()
    assert plan_tools(load_config(repo_root / "configs" / "grpo_demo_cpu.yaml"), tmp_path / "run") is None


def test_a_dead_tool_server_or_sandbox_is_restarted_even_as_the_last_of_its_kind(tmp_path: Path) -> None:
    """services/launcher/supervision.py: tools and sandbox are expendable; the coordinator's death stays fatal."""
    from io import StringIO

    from services.common.processes import ServiceProcess, ServiceStartError
    from services.launcher.stack import LocalStack
    from services.launcher.supervision import Supervisor

    out = StringIO()
    stack = LocalStack(tmp_path, out=out)
    for name in ("sandbox-0", "tools-0", "coordinator"):
        stack.processes.append(ServiceProcess(name, [], tmp_path / f"{name}.log", command=["sleep", "60"]).start())
    supervisor = Supervisor(stack)
    try:
        for index, name in enumerate(("sandbox-0", "tools-0")):
            old = stack.processes[index]
            os.kill(old.pid, signal.SIGKILL)
            old.proc.wait()
            supervisor.check()
            new = stack.processes[index]
            assert new.name == name and new.alive() and new.pid != old.pid and new.command == old.command
            assert (f"{name} (pid {old.pid}) exited with code -9 (killed by SIGKILL); the run goes on (calls it would "
                    f"answer are tool errors until it is back); restarted it as pid {new.pid}") in out.getvalue()
        coordinator = stack.processes[2]
        os.kill(coordinator.pid, signal.SIGKILL)
        coordinator.proc.wait()
        with pytest.raises(ServiceStartError, match=rf"coordinator \(pid {coordinator.pid}\) exited with code -9"):
            supervisor.check()
    finally:
        stack.stop()


def test_tool_calls_run_through_up_and_a_killed_sandbox_costs_no_run(format_warmup: Path, repo_root: Path,
                                                                      tmp_path: Path) -> None:
    iterations = 5
    # lr 0: the model's calls stay what the warm-up made them (a few updates on 16 samples can unlearn the call
    # format, and then no call reaches the sandbox to show it back); this test is about the plumbing.
    up = Up(repo_root, format_warmup, tmp_path, "-o", f"megatron_training.train_iters={iterations}",
            *SMALL, "-o", "actor_config.lr=0", "--run-id", "multi-turn")
    try:
        ready = up.wait_for(r"sandbox-0 ready \(http://127\.0\.0\.1:(\d+)/run_code, for http://localhost:8080/run_code\)",
                            600)
        assert "tools-0 ready" in up.output
        up.wait_for(rf"(?m)^iteration 1/{iterations}", 600)
        sandbox = up.child("sandbox serve")
        os.kill(sandbox, signal.SIGKILL)
        up.wait_for(rf"sandbox-0 \(pid {sandbox}\) exited with code -9 \(killed by SIGKILL\); the run goes on \(calls "
                    r"it would answer are tool errors until it is back\); restarted it as pid \d+", 60)
        wait_until_healthy(f"http://127.0.0.1:{ready.group(1)}/health", 60)
        # The iteration running now may have asked the dead sandbox; every later one starts with it back.
        back_from = len(re.findall(r"(?m)^iteration \d+/", up.output)) + 2
        assert back_from <= iterations, f"the sandbox came back only after iteration {back_from - 2}"
        assert up.finish() == 0, up.output[-4000:]
    finally:
        up.cleanup()
    assert f"run multi-turn: RUN_PHASE_DONE at iteration {iterations}" in up.output, up.output[-3000:]
    assert "Traceback" not in up.output, up.output[-3000:]
    records = metrics(tmp_path)
    assert [int(r["iteration"]) for r in records] == list(range(1, iterations + 1))
    for r in records:
        assert all(k in r for k in TOOL_KEYS), sorted(k for k in TOOL_KEYS if k not in r)
        # The warm-up has the model call the tool on most of its samples (max_tool_calls: 1); a call's answer
        # starts a turn of its own (turns = 1 + calls, less when a trajectory hits its token budget), and sits
        # in the response as context.
        assert 0 < r["tool/calls_per_sample"] <= 1, r["tool/calls_per_sample"]
        assert 1 < r["tool/turns_per_sample"] <= 1 + r["tool/calls_per_sample"] + 1e-9, r["tool/turns_per_sample"]
        assert r["response_length/tool_mean"] > 0 and r["response_length/generated_mean"] > 0
        assert r["response_length/mean"] == pytest.approx(r["response_length/generated_mean"]
                                                          + r["response_length/tool_mean"], rel=1e-6)
    # Calls run in the sandbox (the code is the model's: right or wrong digits, it runs), before the kill and
    # once the restarted one serves; in between, calls may fail, each a tool error its sample carries.
    after_restart = records[back_from - 1:]
    assert records[0]["tool/success_rate"] > 0 and all(r["tool/success_rate"] > 0 for r in after_restart), \
        [(r["iteration"], r["tool/success_rate"]) for r in records]
    assert all(r["tool/timeouts"] == 0 for r in records)
    assert "retool_reward_rewards/mean" in records[-1]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the warm-up (a fixture, counted here: ~350 steps, 10-15 min on 2 cores) and 60 iterations
def test_grpo_with_the_tool_raises_reward_calls_and_success(tool_warmup: Path, repo_root: Path,
                                                           tmp_path: Path) -> None:
    """The demo's marks (examples/multi_turn/report.py: WINDOW, MARKS, set from measured runs) on 60 iterations."""
    iterations = 60
    up = Up(repo_root, tool_warmup, tmp_path, "-o", f"megatron_training.train_iters={iterations}",
            "-o", "generate_config.sampling_config.seed=1", "--run-id", "learn")
    try:
        assert up.finish(3600) == 0, up.output[-4000:]
    finally:
        up.cleanup()
    records = metrics(tmp_path)
    assert [int(r["iteration"]) for r in records] == list(range(1, iterations + 1))
    report = demo_module(repo_root, "report")
    summary = {key: (mean([r[key] for r in records[:report.WINDOW]]), mean([r[key] for r in records[-report.WINDOW:]]))
               for key in report.MARKS}
    print(json.dumps(summary))
    for key, margin in report.MARKS.items():
        first, last = summary[key]
        assert last - first >= margin, (key, summary)


@pytest.mark.slow
def test_a_sandbox_gone_for_good_and_a_killed_tool_server_cost_tool_errors_not_the_run(
        format_warmup: Path, repo_root: Path, tmp_path: Path) -> None:
    """The sandbox is SIGKILLed until `up` stops restarting it (MAX_RESTARTS): every later call is a tool error
    (TOOL_ERROR: the sandbox is unreachable), and the run ends DONE. The tool server, killed once, is restarted."""
    from services.launcher.supervision import MAX_RESTARTS

    iterations = 5
    up = Up(repo_root, format_warmup, tmp_path, "-o", f"megatron_training.train_iters={iterations}",
            *SMALL, "--run-id", "tools-gone")
    try:
        up.wait_for(rf"(?m)^iteration 1/{iterations}", 600)
        tools = up.child("tools serve")
        os.kill(tools, signal.SIGKILL)
        up.wait_for(rf"tools-0 \(pid {tools}\) exited with code -9 \(killed by SIGKILL\); the run goes on", 60)
        for death in range(MAX_RESTARTS + 1):
            pid = up.child("sandbox serve")
            os.kill(pid, signal.SIGKILL)
            if death < MAX_RESTARTS:
                up.wait_for(rf"sandbox-0 \(pid {pid}\) exited .*restarted it as pid \d+", 60)
        up.wait_for(rf"sandbox-0 \(pid {pid}\) exited .*not restarted: it died {MAX_RESTARTS + 1} times", 60)
        gone_after = int(re.findall(r"(?m)^iteration (\d+)/", up.output)[-1])
        assert up.finish() == 0, up.output[-4000:]
    finally:
        up.cleanup()
    assert f"run tools-gone: RUN_PHASE_DONE at iteration {iterations}" in up.output, up.output[-3000:]
    records = metrics(tmp_path)
    assert [int(r["iteration"]) for r in records] == list(range(1, iterations + 1))
    after = [r for r in records if r["iteration"] > gone_after + 1]  # iterations that started with no sandbox
    assert after, (gone_after, iterations)
    for r in after:
        calls = r["tool/calls_per_sample"] * 16  # 4 prompts x 4 samples
        assert calls > 0 and r["tool/success_rate"] == 0 and r["tool/errors"] == pytest.approx(calls), r
