"""One rank's trainer state and the operations every rank runs in lockstep (no gRPC here).

Owns a `TrainerWorker`: this rank's GPTModel (with PPO's value head for the critic), optimizer, scheduler,
iteration, consumed samples and weights version, and the collective operations the server fans out (log-probs,
values, update, checkpoint save/load, offload/onload, info). Every method must be called on every rank of the group with the
same arguments; results that only rank 0 needs are returned there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.common.config.architecture import ModelConfig
from services.common.model_spec import ModelSpec, read_hf_config, spec_from_hf_config
from services.common.weight_version import after_update
from services.trainer import checkpoint, convert, lora, megatron_compat, roles, value_head
from services.trainer.activation_memory import ActivationMemory
from services.trainer.lora import LoraOptions
from services.trainer.memory import UpdateMemory
from services.trainer.model import build_gpt_model
from services.trainer.moe import MoeOptions
from services.trainer.offload import StateOffloader
from services.trainer.optimizer import OptimizerOptions, build_optimizer
from services.trainer.packing import Packing
from services.trainer.parallel import Layout, current_layout
from services.trainer.step import SequenceRows
from services.trainer.update import Experience, UpdateOptions, grpo_update

if TYPE_CHECKING:
    from services.trainer.critic import CriticExperience
    from services.trainer.streamed_update import ExperienceStream

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """What a trainer rank is (role, weights) and how it trains."""

    role: str = roles.ACTOR  # services/trainer/roles.py: "actor", "reference" or "critic"
    hf_dir: str | None = None  # HF folder: architecture, tokenizer assets, and initial weights if no load
    load: str | None = None  # Megatron checkpoint dir (`megatron_training.load`)
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    forward_micro_batch_size: int = 1  # actor_/ref_forward_micro_batch_size; the critic's micro_batch_size
    # use_remove_padding / use_dynamic_bsz with the actor_* or ref_* budgets, for ComputeLogProbs
    forward_packing: Packing = Packing()
    update: UpdateOptions = UpdateOptions()
    optimizer: OptimizerOptions = OptimizerOptions()
    params_dtype: str = "float32"
    activation_memory: ActivationMemory = ActivationMemory()  # recompute_*, sequence_parallel, swap_attention
    moe: MoeOptions = MoeOptions()  # moe_aux_loss_coeff, moe_router_load_balancing_type, moe_token_dispatcher_type
    # The model's layers on each pipeline stage (num_layer_list / noop_layers); None: Megatron's even split.
    stage_layers: tuple[int, ...] | None = None
    # rlfabric.deterministic: torch's deterministic kernels in this process (services/common/determinism.py).
    deterministic: bool = False
    # lora_r / lora_alpha / lora_target_modules (the actor only; None: full weights), and lora_ckpt_filter:
    # checkpoints hold the adapters alone, the base coming from the HF weights (services/trainer/checkpoint.py).
    lora: LoraOptions | None = None
    lora_ckpt_filter: bool = False
    # The critic's value head starts as normal(0, init_method_std) (services/trainer/value_head.py).
    init_method_std: float = ModelConfig().init_method_std


class TrainerWorker:
    """This rank's model (and optimizer, for the actor)."""

    def __init__(self, opts: WorkerOptions) -> None:
        from megatron.core import parallel_state as ps

        self.opts = opts
        roles.check_role(opts.role)
        self.layout: Layout = current_layout()
        self.spec, self.hf_config = self._read_spec()
        dtype = getattr(torch, opts.params_dtype)
        self.model = build_gpt_model(self.spec, tp=self.layout.tp, pp=self.layout.pp, params_dtype=dtype,
                                     memory=opts.activation_memory, moe_opts=opts.moe, stages=opts.stage_layers,
                                     deterministic=opts.deterministic)
        if opts.lora is not None and opts.role != roles.ACTOR:
            raise ValueError(f"the {opts.role} trainer is the base model: LoRA is for the actor")
        if opts.role == roles.CRITIC:
            value_head.attach_value_head(self.model, init_std=opts.init_method_std, seed=opts.update.seed)
        self.optimizer = self.scheduler = None
        self.iteration = 0
        self.consumed_samples = 0
        self.weights_version = 0
        self.last_update_step: int | None = None
        self._tp_rank, self._pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self._load_initial()
        self.offloader = StateOffloader(self.model, self.optimizer, _training_device())

    # ---- set-up -----------------------------------------------------------------------------
    def _read_spec(self) -> tuple[ModelSpec, dict]:
        if self.opts.hf_dir:
            return read_hf_config(self.opts.hf_dir)
        if self.opts.load and (Path(self.opts.load) / "config.json").is_file():
            return read_hf_config(self.opts.load)
        if self.opts.load:
            iter_dir, _ = convert.ckpt_layout.resolve_iter_dir(self.opts.load)
            shards_dir = next(iter_dir.glob("mp_rank_*"))
            payload = torch.load(shards_dir / convert.ckpt_layout.FILENAME, map_location="cpu", weights_only=False)
            raw = payload.get("rlfabric", {}).get("hf_config")
            if raw:
                return spec_from_hf_config(raw, source=str(shards_dir)), raw
        raise ValueError("the trainer needs hf_dir (an HF model folder) or a load dir written by rlfabric")

    def _load_initial(self) -> None:
        """Base weights, then LoRA's adapters (which freeze the base), then the optimizer over what trains, then a
        checkpoint's state (weights, adapters, optimizer, RNG): the optimizer must exist before a checkpoint
        restores its state, and must see only the parameters that train."""
        load_is_hf = bool(self.opts.load) and not (Path(self.opts.load) / convert.ckpt_layout.TRACKER).is_file() \
            and (Path(self.opts.load) / "config.json").is_file()
        from_checkpoint = bool(self.opts.load) and not load_is_hf
        if load_is_hf:
            # MindSpeed-RL configs sometimes point `load` at the HF folder to start from: take its weights.
            logger.info("load=%s is a Hugging Face folder: converting its weights in memory", self.opts.load)
            self.load_hf_weights(self.opts.load)
        elif from_checkpoint and checkpoint.holds_adapters_only(self.opts.load):
            # A lora_ckpt_filter checkpoint: the frozen base comes from the HF weights the run started from.
            if not self.opts.hf_dir:
                raise ValueError(f"{self.opts.load} holds LoRA adapters only (lora_ckpt_filter); the base weights "
                                 "come from the HF folder (tokenizer_name_or_path), which is not set")
            self.load_hf_weights(self.opts.hf_dir)
        elif not from_checkpoint:
            if not self.opts.hf_dir:
                raise ValueError("no initial weights: set hf_dir or load")
            self.load_hf_weights(self.opts.hf_dir)
        if self.opts.lora is not None:
            layers = lora.apply_lora(self.model, self.opts.lora)
            logger.info("LoRA r=%d alpha=%g on %d layers of this rank (%d adapter elements)", self.opts.lora.rank,
                        self.opts.lora.alpha, layers, lora.adapter_numel(self.model))
        if self.opts.role in roles.TRAINING_ROLES:
            self.optimizer, self.scheduler = build_optimizer(self.model, self.opts.optimizer)
        if from_checkpoint:
            res = checkpoint.load_checkpoint(
                self.opts.load,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                finetune=self.opts.finetune,
                no_load_optim=self.opts.no_load_optim or self.optimizer is None,
                no_load_rng=self.opts.no_load_rng,
            )
            self.iteration, self.consumed_samples = res.iteration, res.consumed_samples
            logger.info("rank %d loaded %s (iteration %d)", self.layout.rank, res.path, res.iteration)

    def load_hf_weights(self, hf_dir: str | Path) -> None:
        """Load this rank's shard of an HF folder's weights (converted in memory)."""
        key = (self._tp_rank, self._pp_rank, self.layout.ep_rank)
        shards = convert.hf_to_mcore(convert.load_hf_state(hf_dir), self.spec, self.layout.tp, self.layout.pp, only=key,
                                     ep=self.layout.ep, stages=self.opts.stage_layers)
        checkpoint._load_model_state(self.model, shards[key], Path(hf_dir))
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ---- operations -------------------------------------------------------------------------
    def compute_log_probs(self, rows: SequenceRows, temperature: float, with_entropy: bool = False,
                          adapters_off: bool = False):
        """Log-probs (and entropy) of `rows`' response tokens; `adapters_off`: of the frozen backbone alone, the
        reference under share_backbone (a ValueError on a model without LoRA adapters)."""
        from services.trainer.logprobs import compute_log_probs_rows

        if self.opts.role == roles.CRITIC:
            raise ValueError("the critic's output is a value per position, not log-probs: ComputeLogProbs is the "
                             "actor's and the reference's")
        self.offloader.require("params", what="ComputeLogProbs")
        if adapters_off and not lora.adapters(self.model):
            raise ValueError(f"adapters_off: the {self.opts.role} trainer has no LoRA adapters")
        with lora.adapters_disabled(self.model) if adapters_off else contextlib.nullcontext():
            return compute_log_probs_rows(
                self.model,
                rows,
                temperature=temperature,
                micro_batch_size=self.opts.forward_micro_batch_size,
                with_entropy=with_entropy,
                packing_opts=self.opts.forward_packing,
            )

    def compute_values(self, rows: SequenceRows):
        """PPO's critic: the values of `rows`' response tokens (packed float32 on rank 0, else None)."""
        from services.trainer.critic import compute_values_rows

        if self.opts.role != roles.CRITIC:
            raise ValueError(f"the {self.opts.role} trainer has no value head: ComputeValues is the critic's")
        self.offloader.require("params", what="ComputeValues")
        return compute_values_rows(self.model, rows, self.opts.forward_micro_batch_size, self.opts.forward_packing)

    def update(self, exp: Experience | CriticExperience | ExperienceStream, *, temperature: float = 1.0,
               kl_coef: float = 0.0, step: int) -> dict[str, float]:
        """One optimizer pass over `exp`: the policy loss on the actor (an Experience, or an ExperienceStream still
        arriving), the clipped value loss on the critic (a CriticExperience; temperature and kl_coef unused)."""
        from services.trainer.critic import CriticExperience, critic_update
        from services.trainer.streamed_update import ExperienceStream, grpo_update_streamed

        critic = self.opts.role == roles.CRITIC
        streamed = isinstance(exp, ExperienceStream)
        if self.optimizer is None:
            raise ValueError(f"the {self.opts.role} trainer has no optimizer; Update is for the actor and the critic")
        if critic != isinstance(exp, CriticExperience):
            raise ValueError(f"the {self.opts.role} trainer trains on {'returns and values' if critic else 'advantages'}")
        self.offloader.require("params", "grads", "optimizer", what="Update")
        t0 = time.monotonic()
        with UpdateMemory(self.model, self.optimizer) as mem:
            if streamed:
                metrics = grpo_update_streamed(self.model, self.optimizer, self.scheduler, exp, self.opts.update,
                                               temperature=temperature, kl_coef=kl_coef,
                                               clip_grad=self.opts.optimizer.clip_grad)
            elif critic:
                metrics = critic_update(self.model, self.optimizer, self.scheduler, exp, self.opts.update,
                                        self.opts.optimizer.clip_grad, step)
            else:
                metrics = grpo_update(self.model, self.optimizer, self.scheduler, exp, self.opts.update,
                                      temperature=temperature, kl_coef=kl_coef, clip_grad=self.opts.optimizer.clip_grad,
                                      step=step)
        metrics.update(mem.metrics(self.opts.role))  # memory/{role}/*: a collective, as every rank runs update
        self.iteration = step
        self.last_update_step = step
        self.weights_version = after_update(self.weights_version)
        self.consumed_samples += exp.total_rows if streamed else len(exp.rows)
        metrics[roles.update_timing_key(self.opts.role)] = time.monotonic() - t0
        return metrics

    def can_stream_update(self, batch_rows: int) -> bool:
        """Whether an actor Update of `batch_rows` rows may start before its last row (streamed_update.py)."""
        from services.trainer.streamed_update import can_stream

        return (self.opts.role != roles.CRITIC and self.optimizer is not None
                and can_stream(self.opts.update, self.model, dist.get_world_size() if dist.is_initialized() else 1,
                               batch_rows))

    def save(self, root: str | Path, iteration: int | None = None,
             consumed_samples: int | None = None) -> tuple[Path, int, int]:
        """Writes a checkpoint recording `iteration` and `consumed_samples` (None or 0: the trainer's own);
        returns (iter dir, iteration, consumed samples) as recorded.

        The trainer's own counters do not move: only Update (its step) and LoadCheckpoint do. Saving used to
        adopt the numbers it was given, before it even knew the save could happen, so a refused SaveCheckpoint
        of iteration 2**53+1 (params offloaded) left the trainer at that iteration (the fuzz soak's finding).
        """
        self.offloader.require("params", "optimizer", what="SaveCheckpoint")
        iteration = checkpoint.check_counter("iteration", iteration or self.iteration)
        consumed = checkpoint.check_counter("consumed_samples", consumed_samples or self.consumed_samples)
        path = checkpoint.save_checkpoint(
            root,
            iteration,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            consumed_samples=consumed,
            hf_config=self.hf_config,
            hf_assets_dir=self.opts.hf_dir,
            adapters_only=self.opts.lora is not None and self.opts.lora_ckpt_filter,
        )
        return path, iteration, consumed

    def load(
        self, root: str | Path, *, iteration: int | None = None, finetune: bool = False,
        no_load_optim: bool = False, no_load_rng: bool = False,
    ) -> checkpoint.LoadResult:
        self.offloader.require("params", "optimizer", what="LoadCheckpoint")
        res = checkpoint.load_checkpoint(
            root,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            iteration=iteration,
            finetune=finetune,
            no_load_optim=no_load_optim or self.optimizer is None,
            no_load_rng=no_load_rng,
        )
        self.iteration, self.consumed_samples = res.iteration, res.consumed_samples
        self.weights_version = after_update(self.weights_version)
        return res

    # ---- offload / onload (services/trainer/offload.py) ------------------------------------------
    def offload(self, *, params: bool, grads: bool, optimizer: bool) -> int:
        """Moves the chosen state out of device memory; returns the bytes moved."""
        return self.offloader.offload(_kinds(params, grads, optimizer))

    def onload(self, *, params: bool, grads: bool, optimizer: bool) -> int:
        """Brings back what `offload` moved out; returns the bytes moved."""
        return self.offloader.onload(_kinds(params, grads, optimizer))

    # ---- description ------------------------------------------------------------------------
    def shard_infos(self) -> list[dict]:
        from services.trainer.weights_export import iter_shards

        return [dataclasses.asdict(s.meta) for s in iter_shards(self.model, self.spec)]


def _kinds(params: bool, grads: bool, optimizer: bool) -> list[str]:
    return [k for k, on in (("params", params), ("grads", grads), ("optimizer", optimizer)) if on]


def _training_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if megatron_compat.accelerator_present():
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def gather_objects(obj) -> list | None:
    """All ranks' `obj` on rank 0 (None elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
