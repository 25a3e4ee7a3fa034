"""Megatron-layout checkpoints of a trainer group: save, load, resume semantics, the reference path.

Owns what goes into `iter_XXXXXXX/mp_rank_*/model_optim_rng.pt` and how it is read back:
    model                 this rank's GPTModel state dict (Megatron names, local layer numbers)
    optimizer             fp32 master weights and Adam moments per parameter, whole whatever the
                          data-parallel sharding (services/trainer/optimizer.py): any DP size resumes it
    opt_param_scheduler   Megatron OptimizerParamScheduler state
    rng_state             [{random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state?,
                            rng_tracker_states}] as Megatron names them
    args                  argparse.Namespace with consumed_train_samples, iteration, TP/PP/EP sizes
    iteration, checkpoint_version (3.0), rlfabric {hf_config, tp, pp, ep, stage_layers, adapters_only}

LoRA (services/trainer/lora.py): a LoRA model's state dict holds its adapters beside the base weights
(`<layer>.lora_A.weight`, `<layer>.lora_B.weight`), so a full checkpoint resumes base and adapters alike. With
`lora_ckpt_filter` (`adapters_only`) `model` holds the adapters alone, MindSpeed-LLM's filtered checkpoint: the
frozen base never changes, so a resume takes it from the HF weights the run started from (the trainer loads them
first, `holds_adapters_only` tells it so) and the adapters, optimizer and RNG from here. A LoRA model also loads a
full checkpoint without adapters (a converted base): its base only, the adapters as they are.

PPO's critic: its `value_head.*` are in `model` and resume with it; weights without them (HF, the actor's) load into
a critic with the head initialised afresh, and with `finetune` or `no_load_optim` only (services/trainer/value_head.py).

Semantics as Megatron's `load_checkpoint`: `finetune` loads weights only and restarts at iteration 0
with fresh optimizer and RNG; a `release` checkpoint (converted weights) also starts at 0; otherwise
the iteration and consumed samples come from the checkpoint, the optimizer/scheduler unless
`no_load_optim`, the RNG unless `no_load_rng`. Saving is atomic (see ckpt_layout.py). Only
data-parallel rank 0 of each (TP, PP) position writes; its replicas hold the same model, and a
distributed optimizer's shards are gathered to it first.

Expert parallelism (MoE): as Megatron, each (TP, PP, EP) position has its own folder
(`mp_rank_TT[_PPP]_EEE`), written by the rank at that position whose expert-data-parallel rank is 0; it holds
that rank's whole model (its experts, numbered locally, and the weights every EP rank shares) and the optimizer
state the optimizer hands that rank. A checkpoint loads at the same TP and PP with any data-parallel size and
any EP size that divides the experts (EP is carved out of data parallelism): a rank takes the shared weights
and their optimizer state from EP rank 0's file and each of its experts (weights and state) from the file that
holds it, renumbered to its own local numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from services.trainer import ckpt_layout, lora, value_head
from services.trainer.model import canonical_name, canonical_state_dict, config_stage_layers, unwrap
from services.trainer.weights_export import check_expert_layout

logger = logging.getLogger(__name__)

# The largest iteration, consumed-sample count or weights version the trainer accepts. These counters leave the
# trainer as float64 (the journal's and metrics.jsonl's `iteration`/`weights_version`, Prometheus gauges), which
# is exact up to 2**53; a larger value is a caller's error (the fuzz soak sent 2**53+1 and 2**64-1), not a run.
MAX_COUNTER = 2**53 - 1


def check_counter(field: str, value: int) -> int:
    """`value` when 0 <= value <= MAX_COUNTER; otherwise a ValueError naming `field` (INVALID_ARGUMENT)."""
    if not 0 <= value <= MAX_COUNTER:
        raise ValueError(f"{field} {value} is out of range: at most {MAX_COUNTER} (2**53-1, exact as float64)")
    return value


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What `load_checkpoint` read: the iteration folder, its counters, and which optional states it restored."""

    path: Path  # the iter_XXXXXXX (or release) folder
    iteration: int  # 0 after a finetune load or from a release folder
    consumed_samples: int  # the data cursor to resume from (0 after a finetune load)
    loaded_optimizer: bool  # False with no_load_optim or finetune
    loaded_rng: bool  # False with no_load_rng or finetune


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state.get("rng_tracker_states", {}))


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    root: str | Path,
    iteration: int,
    *,
    model,
    optimizer=None,
    scheduler=None,
    consumed_samples: int = 0,
    hf_config: dict | None = None,
    hf_assets_dir: str | Path | None = None,
    adapters_only: bool = False,
) -> Path:
    """Collective: every rank calls it. Returns the committed `iter_XXXXXXX` directory. `adapters_only`
    (lora_ckpt_filter): the model part holds the LoRA adapters alone."""
    from megatron.core import parallel_state as ps

    if adapters_only and not lora.adapters(model):
        raise ValueError("adapters_only (lora_ckpt_filter) saves LoRA adapters, and this model has none")
    t0 = time.monotonic()
    root = Path(root)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    check_expert_layout()
    # Collective when the optimizer is sharded over data-parallel ranks: every rank sends its part.
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    writer = _writes_checkpoint(ep)
    # Agreed before anything is written: an optimizer that hands a writing rank no state fails the save on every
    # rank (none is left waiting in a barrier for one that raised).
    missing = [e for e in _all_gather_object(ep_rank if writer and optimizer is not None and optimizer_state is None
                                             else None) if e is not None]
    if missing:
        raise ValueError(f"the optimizer returned no state on the rank writing expert-parallel rank {missing[0]}'s "
                         f"checkpoint file (its expert-data-parallel rank 0; EP={ep}): every such rank needs its "
                         "experts' optimizer state")
    tmp = ckpt_layout.tmp_iter_dir(root, iteration)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir()
        if hf_assets_dir is not None and not (root / ckpt_layout.HF_ASSETS).is_dir():
            ckpt_layout.copy_hf_assets(Path(hf_assets_dir), root / ckpt_layout.HF_ASSETS)
    _barrier()
    if writer:
        sizes = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                 "expert_model_parallel_size": ep}
        payload = {
            "model": lora.adapter_state_dict(model) if adapters_only else canonical_state_dict(model),
            "iteration": iteration,
            "checkpoint_version": 3.0,
            "args": argparse.Namespace(consumed_train_samples=consumed_samples, iteration=iteration, **sizes),
            "rng_state": [rng_state()],
            # The layers of each pipeline stage (uneven under num_layer_list / noop_layers): layer numbers are local.
            "rlfabric": {"hf_config": hf_config, **sizes,
                         "stage_layers": list(config_stage_layers(unwrap(model).config)),
                         "adapters_only": adapters_only},
        }
        if optimizer_state is not None:
            payload["optimizer"] = optimizer_state
        if scheduler is not None:
            payload["opt_param_scheduler"] = scheduler.state_dict()
        path = ckpt_layout.shard_path(tmp, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                      pp, ep_rank, ep)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(payload, path)
    _barrier()
    final = root / ckpt_layout.iter_dirname(iteration)
    if dist.get_rank() == 0:
        ckpt_layout.commit_iter_dir(root, iteration)
        logger.info("saved %s in %.2fs", final, time.monotonic() - t0)
    _barrier()
    return final


def load_checkpoint(
    root: str | Path,
    *,
    model,
    optimizer=None,
    scheduler=None,
    iteration: int | None = None,
    finetune: bool = False,
    no_load_optim: bool = False,
    no_load_rng: bool = False,
) -> LoadResult:
    """Load this rank's shard with Megatron's finetune / no_load_optim / no_load_rng semantics."""
    from megatron.core import parallel_state as ps

    iter_dir, it = ckpt_layout.resolve_iter_dir(root, iteration)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    ck_tp, ck_pp, ck_ep = ckpt_layout.detect_tp_pp_ep(iter_dir)
    if (ck_tp, ck_pp) != (tp, pp):
        raise ValueError(
            f"{iter_dir} was saved with tensor_model_parallel_size={ck_tp}, pipeline_model_parallel_size={ck_pp}, "
            f"but this trainer runs TP={tp}, PP={pp}; convert it first "
            f"(`rlfabric convert mcore2hf` then `rlfabric convert hf2mcore --tp {tp} --pp {pp}`)"
        )
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    if ep == ck_ep == 1:
        path = ckpt_layout.shard_path(iter_dir, tp_rank, pp_rank, pp)
        payload = torch.load(path, map_location="cpu", weights_only=False)
    else:
        check_expert_layout()
        path, payload = _expert_payload(iter_dir, model, tp_rank, pp_rank, pp, ck_ep, ep, ep_rank)
    args = payload.get("args")
    # Checked before any state is touched: a checkpoint written elsewhere (or by a trainer that took any
    # number) must neither make an absurd iteration the trainer's own nor leave half-loaded weights behind.
    release = it == ckpt_layout.RELEASE
    _check_stage_layers(model, payload, path)
    iteration_read = check_counter(f"{path}: iteration", int(payload.get("iteration", 0 if release else it)))
    consumed = check_counter(f"{path}: consumed_train_samples",
                             int(getattr(args, "consumed_train_samples", 0)) if args is not None else 0)
    value_head.check_optimizer_resume(model, payload["model"], path, wants_optimizer=optimizer is not None and not (
        finetune or release or no_load_optim))
    if _adapters_only(payload):
        if not lora.adapters(model):
            raise ValueError(f"{path} holds LoRA adapters only (lora_ckpt_filter), and this trainer has none: load "
                             f"the base weights (the HF folder, or a full checkpoint) and set lora_target_modules")
        lora.load_adapter_state_dict(model, payload["model"])
    else:
        _load_model_state(model, payload["model"], path)
    if optimizer is not None:
        optimizer.reload_model_params()  # fp32 masters follow the loaded weights unless the state below has its own
    if finetune or release:
        return LoadResult(iter_dir, 0, 0, False, False)
    loaded_optim = loaded_rng = False
    if not no_load_optim:
        if "optimizer" not in payload:
            raise ValueError(f"{path} has no optimizer state; set no_load_optim: true (or finetune: true) to load it")
        if optimizer is not None:
            optimizer.load_state_dict(payload["optimizer"])
        if scheduler is not None and "opt_param_scheduler" in payload:
            scheduler.load_state_dict(payload["opt_param_scheduler"])
        loaded_optim = True
    if not no_load_rng:
        if not payload.get("rng_state"):
            raise ValueError(f"{path} has no RNG state; set no_load_rng: true to load it")
        set_rng_state(payload["rng_state"][0])
        loaded_rng = True
    return LoadResult(iter_dir, iteration_read, consumed, loaded_optim, loaded_rng)


def _adapters_only(payload: dict) -> bool:
    return bool((payload.get("rlfabric") or {}).get("adapters_only"))


def holds_adapters_only(root: str | Path, iteration: int | None = None) -> bool:
    """Whether the checkpoint under `root` (its latest iteration, or `iteration`) was saved with lora_ckpt_filter:
    its model part is LoRA adapters, and the base weights must come from elsewhere. Reads one rank's file
    memory-mapped (only the small record is touched)."""
    iter_dir, _ = ckpt_layout.resolve_iter_dir(root, iteration)
    path = next(iter_dir.glob(f"mp_rank_*/{ckpt_layout.FILENAME}"), None)
    if path is None:
        return False
    return _adapters_only(torch.load(path, map_location="cpu", weights_only=False, mmap=True))


def _check_stage_layers(model, payload: dict, path: Path) -> None:
    """Refuse a checkpoint whose pipeline stages hold other layers than this model's: its stage-local layer numbers
    would name other layers (a checkpoint without the record is an even split, all rlfabric wrote before)."""
    own = config_stage_layers(unwrap(model).config)
    saved = (payload.get("rlfabric") or {}).get("stage_layers")
    if (len(set(own)) == 1) if saved is None else tuple(saved) == own:
        return
    held = "an even split" if saved is None else f"{list(saved)} layers"
    raise ValueError(f"{path}: its pipeline stages hold {held}, this trainer's {list(own)} (num_layer_list / "
                     f"noop_layers); convert it first (`rlfabric convert mcore2hf`, then `rlfabric convert hf2mcore` "
                     f"with this layout's --num-layer-list / --noop-layers)")


def _writes_checkpoint(ep: int) -> bool:
    """Whether this rank writes its position's file: the first copy of its weights (and of its experts)."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_data_parallel_rank() if ep > 1 else ps.get_data_parallel_rank()) == 0


def _all_gather_object(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _split_experts(state: dict) -> tuple[dict, dict[tuple[str, int, str], object]]:
    """(entries of no expert, {(prefix, local expert number, suffix): value})."""
    shared, experts = {}, {}
    for k, v in state.items():
        m = _LOCAL_EXPERT.match(k)
        if m:
            experts[(m.group(1), int(m.group(2)), m.group(3))] = v
        else:
            shared[k] = v
    return shared, experts


def _expert_payload(iter_dir: Path, model, tp_rank: int, pp_rank: int, pp: int, ck_ep: int, ep: int,
                    ep_rank: int) -> tuple[Path, dict]:
    """This rank's payload from a checkpoint saved at expert-parallel size `ck_ep` (any, the running one too):
    the shared weights, their optimizer state, scheduler, counters and RNG from EP rank 0's file (the RNG from
    this rank's own file when the EP sizes agree: expert-parallel RNG streams differ per EP rank), each local
    expert's weights and optimizer state from the file holding that expert, renumbered to this rank."""
    own_experts = {key[1] for key in _split_experts(canonical_state_dict(model))[1]}
    per = len(own_experts)  # local experts of this stage (0: a stage without MoE layers)
    if per and (per * ep) % ck_ep:
        raise ValueError(f"{iter_dir} was saved with expert_model_parallel_size={ck_ep}, which does not divide this "
                         f"model's {per * ep} experts")
    ck_per = per * ep // ck_ep
    first, last = ep_rank * per, (ep_rank + 1) * per  # model-wide experts of this rank: [first, last)
    files = sorted({0, *(x // ck_per for x in range(first, last))}) if per else [0]
    if ck_ep == ep and ep_rank not in files:
        files.append(ep_rank)
    payloads: dict[int, tuple[Path, dict]] = {}
    for e in files:
        path = ckpt_layout.shard_path(iter_dir, tp_rank, pp_rank, pp, e, ck_ep)
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing (the other folders say expert_model_parallel_size={ck_ep})")
        payloads[e] = (path, torch.load(path, map_location="cpu", weights_only=False))
    path, base = payloads[0]

    def merged(section: dict[int, dict]) -> dict:
        out, _ = _split_experts(section[0])
        for e, state in section.items():
            for (prefix, i, suffix), v in _split_experts(state)[1].items():
                x = e * ck_per + i
                if first <= x < last:
                    out[f"{prefix}{x - first}{suffix}"] = v
        return out

    payload = dict(base, model=merged({e: p["model"] for e, (_, p) in payloads.items()}))
    if ck_ep == ep and "rng_state" in payloads[ep_rank][1]:
        payload["rng_state"] = payloads[ep_rank][1]["rng_state"]
    if all(isinstance(p.get("optimizer"), dict) and "params" in p["optimizer"] for _, p in payloads.values()):
        params = merged({e: p["optimizer"]["params"] for e, (_, p) in payloads.items()})
        payload["optimizer"] = dict(base["optimizer"], params=params)
    elif any("optimizer" in p for _, p in payloads.values()):
        payload.pop("optimizer", None)  # some file lacks it: load_checkpoint asks for no_load_optim
    return path, payload


def _load_model_state(model, state: dict, path: Path) -> None:
    """Copy a canonical (local-spec names) state dict into `model`, checking names and shapes."""
    own = {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    have = {k for k in state if not k.endswith("_extra_state")}
    if not any(lora.is_adapter_name(k) for k in have):
        # Base weights (HF, converted, or a full-weights run) into a LoRA model: the adapters stay as they are.
        own = {k: v for k, v in own.items() if not lora.is_adapter_name(k)}
    fresh_head = not any(value_head.is_head_name(k) for k in have)
    if fresh_head:  # weights without a value head (HF, the actor's) into a critic: its head starts afresh
        own = {k: v for k, v in own.items() if not value_head.is_head_name(k)}
    if set(own) != have:
        missing, extra = sorted(set(own) - have), sorted(have - set(own))
        raise ValueError(f"{path}: model keys do not match this model: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, t in own.items():
        if t.shape != state[k].shape:
            raise ValueError(f"{path}: {k} has shape {tuple(state[k].shape)}, the model expects {tuple(t.shape)}")
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state[k])
    if fresh_head:
        value_head.reset_value_head(model)


class CheckpointPathError(ValueError):
    """A SaveCheckpoint/LoadCheckpoint directory outside the roots this trainer may use."""


def confine(directory: str, roots: list[Path]) -> Path:
    """`directory` resolved (symlinks and `..` followed), when it lies under one of `roots`.

    A trainer serves one run: its checkpoints belong under the config's `save`/`load` directories and the
    `--checkpoint-root`s, not wherever a caller names (a SaveCheckpoint could otherwise write any directory the
    trainer's user can, a LoadCheckpoint read any). No roots: unconfined (a bare trainer for tests and tools).
    """
    path = Path(directory).resolve()
    if not roots or any(path == r or path.is_relative_to(r) for r in roots):
        return path
    raise CheckpointPathError(f"checkpoint directory {directory!r} (resolves to {path}) is outside the directories "
                              f"this trainer may use: {', '.join(map(str, roots))} (the config's save/load and "
                              f"--checkpoint-root)")
