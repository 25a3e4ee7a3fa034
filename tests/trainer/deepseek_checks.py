"""One rank of a DeepSeek-V3 trainer group for test_deepseek_v3.py: moe_checks.py's cases on a DeepSeek-V3 model
(multi-latent attention, shared experts, sigmoid group-limited router with expert bias), and the expert-bias update.

For each `--case EP:DISPATCHER` in turn (Megatron's groups rebuilt in between), as moe_checks.py does: log-probs of
rank_checks' rows through the trainer's ComputeLogProbs path, one forward/backward with the aux loss on, gradients
reduced as Megatron's DDP does (moe_checks' helpers), MoE metrics; rank 0 writes `{work}/moe_ep{EP}_{dispatcher}.pt`. With `--bias-ep EP`: the model built with
`moe_router_enable_expert_bias` and a bias update rate of BIAS_RATE, one training forward/backward over the same
rows with the routed tokens counted per expert (ExpertLoad, summed over the data-parallel ranks), then
expert_bias.update_expert_bias; rank 0 writes `{work}/bias_ep{EP}.pt` with the bias before and after and the counts.

Usage: python tests/trainer/deepseek_checks.py --rank R --world W --port P --hf DIR --work DIR
       [--case EP:DISPATCHER ...] [--bias-ep EP]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from trainer_helpers import rank_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BIAS_RATE = 0.01


def run(hf_dir: str, ep: int, dispatcher: str, hf_state: dict) -> dict:
    from megatron.core import parallel_state as ps
    from moe_checks import AUX_COEFF, TEMPERATURE, hf_grad_name, load_hf_into, megatron_reduced_grads
    from rank_checks import make_rows

    from services.common.model_spec import read_hf_config
    from services.trainer import moe
    from services.trainer.logprobs import compute_log_probs_rows
    from services.trainer.model import build_gpt_model
    from services.trainer.step import run_micro_batches

    spec, _ = read_hf_config(hf_dir)
    ep_rank = ps.get_expert_model_parallel_rank()
    opts = moe.MoeOptions(moe_aux_loss_coeff=AUX_COEFF, moe_token_dispatcher_type=dispatcher)
    model = build_gpt_model(spec, tp=1, pp=1, moe_opts=opts)
    load_hf_into(model, spec, hf_state, ep=ep, ep_rank=ep_rank)
    load = moe.ExpertLoad(model)
    rows = make_rows(spec.vocab_size, 1)
    # Forward micro-batches of 3 rows: DP rank 0 gets rows 0-3 (two micro-batches of 3 and 1 rows), rank 1 rows 4-7.
    log_probs, _ = compute_log_probs_rows(model, rows, temperature=TEMPERATURE, micro_batch_size=3)
    forward_metrics = moe.moe_metrics(model, load)
    model.train()
    model.zero_grad(set_to_none=True)
    mbs = _training_micro_batches(rows)
    run_micro_batches(model, mbs, _nll, forward_only=False)
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
            "update_metrics": update_metrics}


def _training_micro_batches(rows) -> list[dict]:
    """This data-parallel rank's rows in micro-batches of 2 (moe_checks' split)."""
    from megatron.core import parallel_state as ps

    from services.trainer.step import dp_share, make_micro_batch

    share = list(dp_share(len(rows), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()))
    return [make_micro_batch(rows, share[i:i + 2]) for i in range(0, len(share), 2)]


def _nll(logits, mb):
    """The token-mean response NLL of one micro-batch."""
    from moe_checks import TEMPERATURE

    from services.trainer import grpo_loss
    from services.trainer.step import gather_response_logits

    logp, _ = grpo_loss.compute_log_probs(gather_response_logits(logits, mb), mb["resp_tokens"], TEMPERATURE)
    return -(logp * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}


def bias_update(ep: int, hf_state: dict, hf_dir: str) -> dict:
    from megatron.core import parallel_state as ps
    from moe_checks import load_hf_into
    from rank_checks import make_rows

    from services.common.model_spec import read_hf_config
    from services.trainer import expert_bias, moe
    from services.trainer.model import build_gpt_model
    from services.trainer.step import run_micro_batches

    spec, _ = read_hf_config(hf_dir)
    opts = moe.MoeOptions(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=BIAS_RATE)
    model = build_gpt_model(spec, tp=1, pp=1, moe_opts=opts)
    load_hf_into(model, spec, hf_state, ep=ep, ep_rank=ps.get_expert_model_parallel_rank())
    router = moe.routers(model)[0]
    before = router.expert_bias.detach().clone()
    rows = make_rows(spec.vocab_size, 1)
    load = moe.ExpertLoad(model)
    model.train()
    run_micro_batches(model, _training_micro_batches(rows), _nll, forward_only=False)
    counts = load.counts[0].to(torch.float32)
    dist.all_reduce(counts, group=ps.get_data_parallel_group())
    expert_bias.update_expert_bias(model)
    after = router.expert_bias.detach().clone()
    left = router.local_tokens_per_expert.detach().clone()
    load.remove()
    return {"before": before, "after": after, "counts": counts, "counts_left": left}


def main() -> int:
    ap = rank_arguments()
    ap.add_argument("--case", action="append", default=[], help="EP:DISPATCHER, repeatable")
    ap.add_argument("--bias-ep", type=int, default=0, help="run the expert-bias update check at this EP size")
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.trainer import parallel
    from services.trainer.convert import load_hf_state

    hf_state = load_hf_state(a.hf)
    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    for case in a.case:
        ep, dispatcher = int(case.split(":")[0]), case.split(":")[1]
        parallel.init_model_parallel(1, 1, seed=1, ep=ep)
        results = run(a.hf, ep, dispatcher, hf_state)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"moe_ep{ep}_{dispatcher}.pt")
        ps.destroy_model_parallel()
    if a.bias_ep:
        parallel.init_model_parallel(1, 1, seed=1, ep=a.bias_ep)
        results = bias_update(a.bias_ep, hf_state, a.hf)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"bias_ep{a.bias_ep}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
