"""Reward benchmarks: math_equiv vs math-verify on the strict real cases, worker throughput 1 vs 2 workers.

    .venv/bin/python bench/bench_reward.py [--repeats 3] [--skip-accuracy] [--skip-throughput]

A. Accuracy and speed on the 341 strict cases of `../shared/data/verifier_cases.jsonl`: each verifier
   runs in a fresh process, warmed on the other (non-strict) cases, with its caches then cleared, so both
   pay the same one-time costs and neither reuses work on the timed cases. math-verify alone means
   `parse(\\boxed{label})` vs `parse(response)` with MindSpeed-RL's extraction settings (timeouts off).
B. Throughput: `python -m services.reward` workers (one pool process each) as separate processes, fed by
   `RewardClientPool` from this process with the 800 real Qwen2.5-Math responses; fresh workers for every
   repeat, 1 and 2 workers alternating, first on shared cores, then with each worker pinned to a core of
   its own (the client is never pinned). math_equiv streams 10 passes over the responses (8,000 samples,
   a few seconds), busy_3ms one pass. Verifiers: math_equiv, and `busy_3ms` (bench/busy_verifier.py,
   3 ms of CPU per sample, math-verify's cost) to show scaling when verification is the cost.
   scores/s = samples / wall time of the stream.
Prints a markdown table; figures are medians with min-max over repeats.
"""

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = (REPO / ".." / "shared" / "data").resolve()


def load_cases() -> tuple[list[dict], list[dict]]:
    cases = [json.loads(line) for line in (DATA / "verifier_cases.jsonl").open()]
    strict = [c for c in cases if not c.get("disputed") and not c.get("convention_dependent")]
    rest = [c for c in cases if c.get("disputed") or c.get("convention_dependent")]
    return strict, rest


def load_raw() -> list[tuple[str, str]]:
    path = DATA / "verifier" / "raw" / "qwen25math_math_cot_100_responses.jsonl"
    return [(response, row["gt"]) for row in map(json.loads, path.open()) for response in row["code"]]


# -- A: accuracy and per-sample time ------------------------------------------------------------------

def accuracy_child(which: str) -> None:
    """Runs in a fresh process; prints one JSON line."""
    import sympy.core.cache

    from services.reward.verifiers import math_equiv
    from services.reward.verifiers.math import expressions, symbolic

    def run(response: str, label: str) -> bool:
        if which == "math_equiv":
            return math_equiv.score(response, label) == 1.0
        return symbolic.math_verify_equal(response, label)

    strict, rest = load_cases()

    def clear_caches() -> None:
        symbolic._parse_gold.cache_clear()
        symbolic.answers_equal_symbolic.cache_clear()
        expressions._parse.cache_clear()
        sympy.core.cache.clear_cache()

    def timed_pass() -> dict:
        clear_caches()
        times, mistakes = [], []
        for case in strict:
            started = time.perf_counter()
            verdict = run(case["response"], case["ground_truth"])
            times.append(time.perf_counter() - started)
            if verdict != case["expected"]:
                mistakes.append(case["id"])
        times.sort()
        return {"mistakes": mistakes, "mean_ms": 1e3 * sum(times) / len(times),
                "median_ms": 1e3 * times[len(times) // 2], "p90_ms": 1e3 * times[int(len(times) * 0.9)]}

    def real_pass() -> dict:
        clear_caches()
        raw = load_raw()
        started = time.perf_counter()
        for response, label in raw:
            run(response, label)
        return {"mean_ms": 1e3 * (time.perf_counter() - started) / len(raw)}

    for case in rest:  # warm-up: imports, regex compilation, sympy's lazy paths
        run(case["response"], case["ground_truth"])
    first = timed_pass()
    # Steady state: the parsers' process-wide tables (ANTLR DFA) are now warm, as in a worker that has
    # been serving for a while; the answer and label caches are cleared again, so no verdict is reused.
    steady = timed_pass()
    print(json.dumps({"first": first, "steady": steady, "real": real_pass()}))


def bench_accuracy(repeats: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {"math_equiv": [], "math_verify": []}
    for _ in range(repeats):
        for which in results:  # alternate, side by side
            out = subprocess.run([sys.executable, __file__, "--accuracy-child", which], cwd=REPO, check=True,
                                 capture_output=True, text=True, timeout=900).stdout
            results[which].append(json.loads(out.strip().splitlines()[-1]))
    return results


# -- B: worker throughput -----------------------------------------------------------------------------

BUSY_PLUGIN = f"busy_3ms={REPO / 'bench' / 'busy_verifier.py'}:busy_3ms"
WORKLOADS = ("math_equiv", "busy_3ms")
# Passes over the 800 real responses per timed stream (each sample gets its own id; the worker's
# label cache is warm after the first pass, as it is in training where a group shares its label).
STREAM_PASSES = {"math_equiv": 10, "busy_3ms": 1}


def _pin_to(core: int | None):
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})  # inherited by the worker's forkserver and pool process


def start_workers(count: int, redis_url: str, tag: str, pin: bool = False) -> list[subprocess.Popen]:
    """`count` workers; with `pin`, worker i (its gRPC process and its pool process) runs on core i only."""
    cores = sorted(os.sched_getaffinity(0))
    return [subprocess.Popen([sys.executable, "-m", "services.reward", "--redis-url", redis_url,
                              "--worker-id", f"{tag}-{i}", "--processes", "1", "--log-level", "ERROR",
                              "--verifier-plugin", BUSY_PLUGIN],
                             cwd=REPO, stdout=subprocess.DEVNULL,
                             preexec_fn=_pin_to(cores[i % len(cores)] if pin else None)) for i in range(count)]


def stop_workers(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _process_cpu_s(pids: list[int]) -> float:
    """User+system CPU seconds of `pids` so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _worker_tree(pids: list[int]) -> dict[str, list[int]]:
    """{"server": worker pids, "pool": their pool-process descendants}."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    pool, stack = [], [c for p in pids for c in children.get(p, [])]
    while stack:
        pid = stack.pop()
        pool.append(pid)
        stack.extend(children.get(pid, []))
    return {"server": list(pids), "pool": pool}


def one_throughput_run(workers: int, raw: list[tuple[str, str]], redis_url: str, tag: str,
                       pin: bool = False) -> dict[str, float]:
    from rlfabric.v1 import reward_pb2
    from services.common.redis_store import Registry, connect
    from services.common.service_kind import ServiceKind
    from services.coordinator.reward_pool import RewardClientPool

    registry = Registry(connect(redis_url))
    processes = start_workers(workers, redis_url, tag, pin)
    try:
        deadline = time.monotonic() + 120
        while len([m for m in registry.members(ServiceKind.REWARD) if m.instance_id.startswith(tag)]) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register within 120 s")
            time.sleep(0.1)
        pool = RewardClientPool(registry, max_inflight_per_worker=64)

        def requests(prefix: str, items: list[tuple[str, str]], verifier: str):
            spec = [reward_pb2.VerifierSpec(name=verifier, weight=1.0)]
            for i, (response, label) in enumerate(items):
                yield reward_pb2.ScoreRequest(sample_id=f"{prefix}/{i}", response=response, ground_truth=label,
                                              verifiers=spec)

        import resource

        rates = {}
        tree = _worker_tree([p.pid for p in processes])
        for verifier in WORKLOADS:
            # Warm-up on a few unrelated samples (connections, first calls), not timed.
            warm = [(f"\\boxed{{{i}}}", "7") for i in range(64)]
            assert sum(1 for _ in pool.score(requests(f"warm-{verifier}", warm, verifier))) == len(warm)
            # Enough samples for a few seconds of stream: at thousands of scores/s, one pass over the
            # 800 responses lasts a quarter of a second, shorter than the other jobs' scheduling noise.
            stream = raw * STREAM_PASSES[verifier]
            # Built before the clock starts: making requests is the producer's (rollout's) work, not the
            # reward path's, and would otherwise be counted as client CPU.
            prebuilt = list(requests(f"run-{verifier}", stream, verifier))
            before = {part: _process_cpu_s(pids) for part, pids in tree.items()}
            usage = resource.getrusage(resource.RUSAGE_SELF)
            client_before = usage.ru_utime + usage.ru_stime
            started = time.perf_counter()
            answered = sum(1 for _ in pool.score(prebuilt))
            rates[verifier] = answered / (time.perf_counter() - started)
            assert answered == len(stream)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            rates[f"{verifier}/cpu_ms_client"] = 1e3 * (usage.ru_utime + usage.ru_stime - client_before) / answered
            for part, pids in tree.items():
                rates[f"{verifier}/cpu_ms_{part}"] = 1e3 * (_process_cpu_s(pids) - before[part]) / answered
        rates["load1"] = os.getloadavg()[0]
        return rates
    finally:
        stop_workers(processes)


# (workers, pinned): unpinned processes share all cores with the client and everything else on the box;
# pinned, each worker (gRPC process + pool process) gets one core of its own, the client floats.
PLACEMENTS = ((1, False), (2, False), (1, True), (2, True))


def bench_throughput(repeats: int) -> dict[tuple[int, bool], list[dict[str, float]]]:
    from services.common.redis_store import start_private_redis

    raw = load_raw()
    redis = start_private_redis()
    results: dict[tuple[int, bool], list[dict[str, float]]] = {placement: [] for placement in PLACEMENTS}
    try:
        for repeat in range(repeats):
            for workers, pin in PLACEMENTS:  # alternate, side by side
                tag = f"b{repeat}w{workers}{'p' if pin else ''}"
                results[(workers, pin)].append(one_throughput_run(workers, raw, redis.url, tag, pin))
    finally:
        redis.stop()
    return results


def scaling_ceiling(client: float, server: float, pool: float, cores: int, pinned: bool) -> float:
    """The best 2-worker / 1-worker ratio the measured CPU per sample (ms) allows on `cores` cores.

    Each process is single-threaded for this work; all of them share `cores` with the client.
    Unpinned, one worker is limited by its busiest process; pinned, by its one core (server + pool).
    """
    total = client + server + pool
    if pinned:
        one = min(1 / (server + pool), 1 / client, cores / total)
        two = min(2 / (server + pool), 1 / client, cores / total)
    else:
        one = min(1 / server, 1 / pool, 1 / client, cores / total)
        two = min(2 / server, 2 / pool, 1 / client, cores / total)
    return two / one


# -- report -------------------------------------------------------------------------------------------

def fmt(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def machine() -> str:
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} cores (shared; load average at start {load}), Python "
            f"{platform.python_version()}, math-verify {version('math-verify')}, mathruler {version('mathruler')}, "
            f"grpcio {version('grpcio')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--accuracy-child", choices=["math_equiv", "math_verify"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.accuracy_child:
        accuracy_child(args.accuracy_child)
        return 0
    print(f"Machine: {machine()}; {args.repeats} repeats, median (min-max).\n")
    started = time.monotonic()
    if not args.skip_accuracy:
        acc = bench_accuracy(args.repeats)
        print("### math_equiv vs math-verify, 341 strict real cases\n")
        print("| pass | verifier | mistakes | mean ms/sample | median ms/sample | p90 ms/sample |")
        print("|---|---|---|---|---|---|")
        for phase, label in (("first", "first pass"), ("steady", "steady state")):
            eq = [r[phase] for r in acc["math_equiv"]]
            mv = [r[phase] for r in acc["math_verify"]]
            for name, runs in (("math_equiv", eq), ("math-verify alone", mv)):
                print(f"| {label} | {name} | {len(runs[0]['mistakes'])} ({', '.join(runs[0]['mistakes'])}) | "
                      f"{fmt([r['mean_ms'] for r in runs])} | {fmt([r['median_ms'] for r in runs], 3)} | "
                      f"{fmt([r['p90_ms'] for r in runs])} |")
            mean_ratio = [m["mean_ms"] / e["mean_ms"] for e, m in zip(eq, mv, strict=True)]
            median_ratio = [m["median_ms"] / e["median_ms"] for e, m in zip(eq, mv, strict=True)]
            print(f"| {label} | speed-up (same run) | | {fmt(mean_ratio, 1)}x | {fmt(median_ratio, 0)}x | |")
        print("\nfirst pass: after a warm-up on the 121 other cases; steady state: a second pass over the same "
              "cases with every answer/label cache cleared (only parser tables stay warm).\n")
        eq_real = [r["real"]["mean_ms"] for r in acc["math_equiv"]]
        mv_real = [r["real"]["mean_ms"] for r in acc["math_verify"]]
        ratio = [m / e for e, m in zip(eq_real, mv_real, strict=True)]
        print(f"On the 800 real Qwen2.5-Math responses (label caches cleared first; a group's 8 samples share "
              f"a label): math_equiv {fmt(eq_real, 3)} ms/sample, math-verify alone {fmt(mv_real, 3)} ms/sample, "
              f"speed-up {fmt(ratio, 1)}x.\n")
    if not args.skip_throughput:
        tp = bench_throughput(args.repeats)
        print("### Reward workers on the 800 real responses (client pool over gRPC, 1 pool process per worker)\n")
        print("| verifier | placement | 1 worker, scores/s | 2 workers, scores/s | 2 / 1 (same repeat) |")
        print("|---|---|---|---|---|")
        for verifier in WORKLOADS:
            for pin, placement in ((False, "shared cores"), (True, "one core per worker")):
                one = [r[verifier] for r in tp[(1, pin)]]
                two = [r[verifier] for r in tp[(2, pin)]]
                ratio = [b / a for a, b in zip(one, two, strict=True)]
                print(f"| {verifier} | {placement} | {fmt(one, 0)} | {fmt(two, 0)} | {fmt(ratio)}x |")
        loads = [r["load1"] for runs in tp.values() for r in runs]
        print(f"\n1-minute load average after each run: {fmt(loads, 1)}.")
        print("\nCPU per sample with 1 worker on shared cores (ms; client = this process, server = the worker's "
              "gRPC process, pool = its verifier process), and the best 2/1 ratio that CPU allows on "
              f"{os.cpu_count()} cores with the client on the same box:\n")
        print("| verifier | client | server | pool | ceiling, shared | ceiling, one core per worker |")
        print("|---|---|---|---|---|---|")
        for verifier in WORKLOADS:
            parts = {part: [r[f"{verifier}/cpu_ms_{part}"] for r in tp[(1, False)]] for part in ("client", "server", "pool")}
            medians = {part: statistics.median(values) for part, values in parts.items()}
            ceilings = [scaling_ceiling(medians["client"], medians["server"], medians["pool"], os.cpu_count() or 1, pin)
                        for pin in (False, True)]
            cells = [fmt(values, 3) for values in parts.values()]
            print(f"| {verifier} | {' | '.join(cells)} | {ceilings[0]:.2f}x | {ceilings[1]:.2f}x |")
        print()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Took {time.monotonic() - started:.0f} s; load average at the end {load}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
