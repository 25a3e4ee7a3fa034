"""The operations a trainer group runs on every rank: name -> callable on this rank's `TrainerWorker`.

Rank 0's servicer (services/trainer/server.py) validates a call and fans it out by name (services/trainer/group.py);
every rank, rank 0 included, runs the same callable with the same arguments (numpy arrays and plain values, as the
command bus pickles them).
"""

from __future__ import annotations

import numpy as np


def worker_handlers(worker) -> dict:
    """Operation name -> callable on this rank's worker (same table on every rank)."""
    import torch

    from services.trainer import inputs
    from services.trainer.critic import CriticExperience
    from services.trainer.step import SequenceRows
    from services.trainer.streamed_update import ExperienceStream
    from services.trainer.update import Experience

    def rows(token_ids, prompt_lengths, response_lengths, routed_experts=None) -> SequenceRows:
        return SequenceRows(torch.from_numpy(np.asarray(token_ids, dtype=np.int64)),
                            torch.from_numpy(np.asarray(prompt_lengths, dtype=np.int64)),
                            torch.from_numpy(np.asarray(response_lengths, dtype=np.int64)),
                            None if routed_experts is None else torch.from_numpy(np.asarray(routed_experts,
                                                                                            dtype=np.int64)))

    def log_probs(token_ids, prompt_lengths, response_lengths, temperature, with_entropy, routed_experts=None,
                  adapters_off=False):
        return worker.compute_log_probs(rows(token_ids, prompt_lengths, response_lengths, routed_experts),
                                        temperature, with_entropy, adapters_off=adapters_off)

    def values(token_ids, prompt_lengths, response_lengths, routed_experts=None):
        return worker.compute_values(rows(token_ids, prompt_lengths, response_lengths, routed_experts))

    def experience(token_ids, prompt_lengths, response_lengths, advantages=None, old_log_probs=None,
                   ref_log_probs=None, behavior_log_probs=None, routed_experts=None, response_mask=None,
                   token_advantages=None, returns=None, values=None):
        def t(x):
            return None if x is None else torch.from_numpy(np.asarray(x, dtype=np.float32))

        sequences = rows(token_ids, prompt_lengths, response_lengths, routed_experts)
        if response_mask is not None:
            sequences.response_mask = torch.from_numpy(np.asarray(response_mask, dtype=np.bool_))
        if worker.opts.role == "critic":  # returns and values (server.py checked the fields of the role)
            return CriticExperience(sequences, t(returns), t(values))
        return Experience(sequences, t(advantages), t(old_log_probs), t(ref_log_probs), t(behavior_log_probs),
                          token_advantages=t(token_advantages))

    def update(step, temperature=1.0, kl_coef=0.0, **arrays):
        return worker.update(experience(**arrays), temperature=temperature, kl_coef=kl_coef, step=step)

    def update_streamed(step, temperature, kl_coef, batch_rows, parts):
        # `parts`: the call's (request, its Sequences) as they come (a single-rank group: nothing broadcast)
        def build(items):
            requests, seqs = zip(*items, strict=True)
            return experience(**inputs.experience_arrays(requests, seqs, worker.opts.role))

        stream = ExperienceStream(parts, batch_rows, rows_of=lambda item: len(item[1]), build=build)
        return worker.update(stream, temperature=temperature, kl_coef=kl_coef, step=step)

    def push_weights(**kwargs):
        from services.trainer.weight_sync import push_weights as push

        return push(worker, **kwargs)

    def shards():
        from megatron.core import parallel_state as ps

        from services.trainer.worker import gather_objects

        # One copy of each (tp, pp, ep) rank's shards: data-parallel replicas hold the same ones. With expert
        # parallelism the first copy of each EP rank's experts is on its expert-data-parallel rank 0.
        first_copy = ps.get_expert_data_parallel_rank() == 0 if worker.layout.ep > 1 else worker.layout.dp_rank == 0
        parts = gather_objects(worker.shard_infos() if first_copy else [])
        return [s for part in (parts or []) for s in part]

    return {
        "log_probs": log_probs,
        "values": values,
        "update": update,
        "update_streamed": update_streamed,
        "save": lambda root, iteration, consumed_samples: worker.save(root, iteration, consumed_samples),
        "load": lambda root, iteration, finetune, no_load_optim, no_load_rng: worker.load(
            root, iteration=iteration, finetune=finetune, no_load_optim=no_load_optim, no_load_rng=no_load_rng),
        "offload": lambda params, grads, optimizer: worker.offload(params=params, grads=grads, optimizer=optimizer),
        "onload": lambda params, grads, optimizer: worker.onload(params=params, grads=grads, optimizer=optimizer),
        "shards": shards,
        "push_weights": push_weights,
    }
