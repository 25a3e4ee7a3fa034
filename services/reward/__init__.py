"""The reward service: rule verifiers run by independently scaled workers, plus custom remote verifiers.

Layout:
- `verifiers/`: the rules, one module each, `verifiers/registry.py` the name table, `verifiers/math/` the
  math-equivalence helpers they share;
- `pool.py` + `pool_child.py` + `pool_preload.py`: the process pool with per-sample deadlines;
- `scoring.py`: one `Score` stream (checks each sample, starts its verifications, builds its response);
  `rewards.py`: the weighted sum; `outcome.py`: one verification's result;
- `server.py`: the `rlfabric.v1.Reward` servicer; `wire.py`: lenient request parsing (a field that is not
  UTF-8 is named, not INTERNAL); `worker.py`: servicer + server + Redis registration;
- `remote.py` / `verifier_store.py` / `endpoints.py`: registered remote verifiers, their Redis registry
  and the `--verifier-allow` list their endpoints must pass;
- `offline.py`: JSONL scoring (`rlfabric reward score`); `metrics.py`; `cli.py`.
The coordinator-side pool over many workers is `services/coordinator/reward_pool.py`: it speaks only
the Reward proto.
"""
