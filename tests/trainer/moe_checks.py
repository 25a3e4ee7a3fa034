"""One rank of a MoE trainer group for test_moe_model.py: the tiny Qwen3-MoE built on Megatron's MoELayer, for each
expert-parallel size in turn (same processes, Megatron's groups rebuilt in between).

For each `--ep`: the HF weights loaded (convert.hf_to_mcore: services/common/weight_layout.py's expert names), log-probs of rank_checks' rows
through the trainer's ComputeLogProbs path, then one forward/backward through Megatron's schedule (the token-mean
response NLL, aux loss on) with the gradients reduced as Megatron's DDP does (non-expert weights averaged over the
data-parallel group; experts summed over the expert-data-parallel group and divided by the DP size), and the MoE
metrics of both passes. Rank 0 writes `{work}/moe_ep{EP}_{dispatcher}.pt` with HF-named full gradients.

Usage: python tests/trainer/moe_checks.py --rank R --world W --port P --hf DIR --work DIR --case EP:DISPATCHER ...
       (e.g. --case 1:allgather --case 2:alltoall; each case in turn)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from trainer_helpers import rank_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEMPERATURE, AUX_COEFF = 0.7, 0.01
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def load_hf_into(model, spec, hf_state: dict, *, ep: int, ep_rank: int) -> None:
    """TP 1 / PP 1: this EP rank's shard of the HF weights, as the trainer converts them."""
    from services.trainer import checkpoint, convert

    key = (0, 0, ep_rank)
    state = convert.hf_to_mcore(hf_state, spec, 1, 1, only=key, ep=ep)[key]
    checkpoint._load_model_state(model, state, Path("hf"))


def hf_grad_name(name: str, ep_rank: int, local_per_rank: int) -> str:
    """Megatron parameter name -> the HF name of what it holds (experts: `experts.e.fc1|fc2` with the global e)."""
    m = _EXPERT.match(name)
    if m:
        layer, i, fc = int(m.group(1)), int(m.group(2)), m.group(3)
        return f"model.layers.{layer}.mlp.experts.{ep_rank * local_per_rank + i}.{fc}"
    return name


def megatron_reduced_grads(model) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        expert = not getattr(p, "allreduce", True)  # Megatron tags expert-parallel weights allreduce=False
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        dist.all_reduce(g, group=group)
        out[name] = g / dp
    return out


def run(a, ep: int, dispatcher: str, hf_state: dict) -> dict:
    from megatron.core import parallel_state as ps
    from rank_checks import make_rows

    from services.common.model_spec import read_hf_config
    from services.trainer import grpo_loss, moe
    from services.trainer.logprobs import compute_log_probs_rows
    from services.trainer.model import build_gpt_model
    from services.trainer.step import dp_share, gather_response_logits, make_micro_batch, run_micro_batches

    spec, _ = read_hf_config(a.hf)
    ep_rank = ps.get_expert_model_parallel_rank()
    opts = moe.MoeOptions(moe_aux_loss_coeff=AUX_COEFF, moe_token_dispatcher_type=dispatcher)
    model = build_gpt_model(spec, tp=1, pp=1, moe_opts=opts)
    load_hf_into(model, spec, hf_state, ep=ep, ep_rank=ep_rank)
    load = moe.ExpertLoad(model)
    rows = make_rows(spec.vocab_size, 1)
    # Forward micro-batches of 3 rows: DP rank 0 gets rows 0-3 (two micro-batches of 3 and 1 rows), rank 1 rows 4-7.
    log_probs, _ = compute_log_probs_rows(model, rows, temperature=TEMPERATURE, micro_batch_size=3)
    forward_metrics = moe.moe_metrics(model, load)
    replayed = replay_log_probs(a, model, rows, spec)
    load.reset()

    model.train()
    share = list(dp_share(len(rows), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()))
    mbs = [make_micro_batch(rows, share[i:i + 2]) for i in range(0, len(share), 2)]

    def loss_fn(logits, mb):
        logp, _ = grpo_loss.compute_log_probs(gather_response_logits(logits, mb), mb["resp_tokens"], TEMPERATURE)
        mask = mb["response_mask"]
        return -(logp * mask).sum() / mask.sum(), {}

    model.zero_grad(set_to_none=True)
    run_micro_batches(model, mbs, loss_fn, forward_only=False)
    update_metrics = moe.moe_metrics(model, load, num_micro_batches=len(mbs))
    per = spec.moe.num_experts // ep
    grads = {hf_grad_name(n, ep_rank, per): g for n, g in megatron_reduced_grads(model).items()}
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(grads, parts, dst=0)
    load.remove()
    if dist.get_rank() != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, g in part.items():
            if k in merged:  # a replicated weight: every rank holds the same reduced gradient
                assert torch.equal(merged[k], g), k
            merged[k] = g
    return {"log_probs": log_probs, "grads": merged, "forward_metrics": forward_metrics,
            "update_metrics": update_metrics, "replay": replayed}


def replay_log_probs(a, model, rows, spec) -> dict[str, torch.Tensor]:
    """Log-probs with routing replay (services/trainer/routing_replay.py) of: HF's own experts ("own"), only free
    rows ("free"), random experts ("forced", also packed: "forced_packed"); plus the random routing itself."""
    import dataclasses

    import transformers
    from routing_reference import hf_routing, random_routing

    from services.trainer import packing
    from services.trainer.logprobs import compute_log_probs_rows

    hf = transformers.AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32).eval()
    moe_spec = spec.moe
    forced = random_routing(rows.token_ids.numel(), len(moe_spec.moe_layers), moe_spec.num_experts,
                            moe_spec.num_experts_per_tok, seed=7)
    cases = {"own": (hf_routing(hf, rows), packing.Packing()), "free": (torch.full_like(forced, -1), packing.Packing()),
             "forced": (forced, packing.Packing()), "forced_packed": (forced, packing.Packing(remove_padding=True))}
    out = {"routing": forced}
    for name, (routed, packing_opts) in cases.items():
        out[name], _ = compute_log_probs_rows(model, dataclasses.replace(rows, routed_experts=routed),
                                              temperature=TEMPERATURE, micro_batch_size=3, packing_opts=packing_opts)
    return out


def main() -> int:
    ap = rank_arguments()
    ap.add_argument("--case", action="append", required=True, help="EP:DISPATCHER, repeatable")
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.trainer import parallel
    from services.trainer.convert import load_hf_state

    hf_state = load_hf_state(a.hf)
    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    for case in a.case:
        ep, dispatcher = int(case.split(":")[0]), case.split(":")[1]
        layout = parallel.init_model_parallel(1, 1, seed=1, ep=ep)
        assert (layout.ep, layout.ep_rank) == (ep, a.rank % ep if ep > 1 else 0), layout
        results = run(a, ep, dispatcher, hf_state)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"moe_ep{ep}_{dispatcher}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
