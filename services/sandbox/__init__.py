"""The code sandbox service: SandboxFusion's `/run_code` HTTP API over bubblewrap-isolated Python runs.

`schema.py` holds the wire format (SandboxFusion's field names, exactly), `isolation.py` builds the bubblewrap
command line, `runner.py` runs one request under its limits, `admission.py` holds `num_workers` and
`rate_limit`, `server.py` the HTTP server and `cli.py` `rlfabric sandbox serve`. How it isolates and what each
limit means: docs/architecture.md, "Code sandbox".
"""
