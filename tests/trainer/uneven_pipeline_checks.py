"""One rank of a PP 2 trainer group with uneven stages (2 processes) for test_uneven_pipeline.py.

For each `--stages A,B` (the model's layers on the two stages, as services/common/pipeline_layout.py derives them
from num_layer_list / noop_layers), in the same processes: the model built with that layout from the HF weights,
log-probs of the rows of rank_checks.py, one GRPO update from the HF weights (with `--uniform N`: full uniform
recompute in units of N layers), the weight-sync shards (name, shape) of every rank, and a checkpoint
`{work}/ckpt_A_B`. Rank 0 writes `{work}/results_A_B.pt` (log-probs, the update's metrics, shards by rank). With
`--moe-hf DIR --moe-stages A,B`: that mixture-of-experts model's log-probs at that layout, `{work}/moe_A_B.pt`.

Usage: python tests/trainer/uneven_pipeline_checks.py --rank R --world 2 --port P --hf DIR --work DIR
       --stages 1,3 --uniform 0 [--stages 3,1 --uniform 3 ...] [--moe-hf DIR --moe-stages 1,2]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEMPERATURE, KL_COEF, LR = 0.7, 0.05, 2e-4


def main() -> int:
    from trainer_helpers import rank_arguments

    ap = rank_arguments()
    ap.add_argument("--stages", action="append", required=True, help="layers of stage 0,1; repeatable")
    ap.add_argument("--uniform", action="append", type=int, default=None,
                    help="full uniform recompute unit of the --stages of the same position (0: none)")
    ap.add_argument("--moe-hf", default=None)
    ap.add_argument("--moe-stages", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    units = a.uniform or [0] * len(a.stages)
    for text, unit in zip(a.stages, units, strict=True):
        stages = tuple(int(n) for n in text.split(","))
        parallel.init_model_parallel(1, len(stages), seed=1)
        results = run_layout(a, stages, unit)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"results_{'_'.join(map(str, stages))}.pt")
        ps.destroy_model_parallel()
    if a.moe_hf:
        stages = tuple(int(n) for n in a.moe_stages.split(","))
        parallel.init_model_parallel(1, len(stages), seed=1)
        log_probs = forward_only(a.moe_hf, stages)
        if a.rank == 0:
            torch.save(log_probs, Path(a.work) / f"moe_{'_'.join(map(str, stages))}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


def run_layout(a, stages: tuple[int, ...], unit: int) -> dict:
    from megatron.core import parallel_state as ps
    from rank_checks import broadcast, make_experience, make_rows

    from services.common.model_spec import read_hf_config
    from services.trainer import checkpoint, convert
    from services.trainer.activation_memory import ActivationMemory
    from services.trainer.logprobs import compute_log_probs_rows
    from services.trainer.model import build_gpt_model
    from services.trainer.optimizer import OptimizerOptions, build_optimizer
    from services.trainer.update import UpdateOptions, grpo_update
    from services.trainer.weights_export import iter_shards
    from services.trainer.worker import gather_objects

    spec, raw = read_hf_config(a.hf)
    memory = ActivationMemory(recompute_granularity="full", recompute_method="uniform",
                              recompute_num_layers=unit) if unit else ActivationMemory()
    model = build_gpt_model(spec, tp=1, pp=len(stages), memory=memory, stages=stages)
    key = (0, ps.get_pipeline_model_parallel_rank(), 0)
    shards = convert.hf_to_mcore(convert.load_hf_state(a.hf), spec, 1, len(stages), only=key, stages=stages)
    checkpoint._load_model_state(model, shards[key], Path(a.hf))
    optimizer, scheduler = build_optimizer(model, OptimizerOptions(lr=LR))

    rows = make_rows(spec.vocab_size, 1)
    log_probs, _ = compute_log_probs_rows(model, rows, temperature=TEMPERATURE, micro_batch_size=3)
    log_probs = broadcast(log_probs, rows.num_response_tokens)
    metrics = grpo_update(model, optimizer, scheduler, make_experience(rows, log_probs, seed=7),
                          UpdateOptions(micro_batch_size=2, mini_batch_rows=0), temperature=TEMPERATURE,
                          kl_coef=KL_COEF, clip_grad=1.0, step=1)
    shards = gather_objects((key[1], [(s.meta.name, s.meta.shape) for s in iter_shards(model, spec)]))
    tag = "_".join(map(str, stages))
    checkpoint.save_checkpoint(Path(a.work) / f"ckpt_{tag}", 1, model=model, optimizer=optimizer,
                               scheduler=scheduler, hf_config=raw, hf_assets_dir=a.hf)
    return {"log_probs": log_probs, "metrics": metrics, "shards": dict(shards or [])}


def forward_only(hf_dir: str, stages: tuple[int, ...]) -> torch.Tensor | None:
    """Log-probs of rank_checks' rows by the model of `hf_dir` built at `stages` (rank 0; None elsewhere)."""
    from megatron.core import parallel_state as ps
    from rank_checks import make_rows

    from services.common.model_spec import read_hf_config
    from services.trainer import checkpoint, convert
    from services.trainer.logprobs import compute_log_probs_rows
    from services.trainer.model import build_gpt_model

    spec, _ = read_hf_config(hf_dir)
    model = build_gpt_model(spec, tp=1, pp=len(stages), stages=stages)
    key = (0, ps.get_pipeline_model_parallel_rank(), 0)
    shards = convert.hf_to_mcore(convert.load_hf_state(hf_dir), spec, 1, len(stages), only=key, stages=stages)
    checkpoint._load_model_state(model, shards[key], Path(hf_dir))
    return compute_log_probs_rows(model, make_rows(spec.vocab_size, 1), temperature=TEMPERATURE,
                                  micro_batch_size=3)[0]


if __name__ == "__main__":
    sys.exit(main())
