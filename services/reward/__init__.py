"""The reward service: rule verifiers run by independently scaled workers, plus custom remote verifiers.

Layout: `verifiers/` (pure scoring rules, one module each, and `registry.py`), `rewards.py` (weighted sum,
DAPO overlong shaping, `{name}_rewards/mean`), `pool.py` + `pool_child.py` (process pool with per-sample
deadlines), `server.py` (the `rlfabric.v1.Reward` servicer), `worker.py` (servicer + server + Redis
registration), `remote.py` / `verifier_store.py` (registered remote verifiers), `offline.py` (JSONL
scoring), `metrics.py`, `cli.py`. The coordinator-side pool over many workers is
`services/coordinator/reward_pool.py`: it speaks only the Reward proto.
"""
