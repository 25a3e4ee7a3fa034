"""Tool servers for multi-turn rollouts: the tools of a MindSpeed-RL tool YAML behind `rlfabric.v1.Tool`.

    cli.py               `rlfabric tools serve | retrieval-serve | list | call`
    worker.py            server + Redis registration (`rlfabric:members:tools:{id}`), start/stop as one
    server.py            the servicer: protos <-> host.py
    host.py              the tools of one server; a call's arguments, worker, slot and deadline
    code_interpreter.py  ReTool / SandboxFusionTool -> SandboxFusion `/run_code`
    search.py            SearchTool -> a retrieval server's `/retrieve`
    limits.py            `rate_limit` across servers (a semaphore in Redis)
    arguments.py         arguments JSON and the schema check (pure)
    http_json.py         the one HTTP client
    retrieval.py         a BM25 `/retrieve` server over a corpus JSONL (tests, demos)
    metrics.py           Prometheus collectors
The YAML itself is read and validated by services/common/config/tools.py (also used by `rlfabric config check`).
"""
