"""WorkerOptions from a MindSpeed-RL configuration (the only place that reads config for the trainer)."""

from __future__ import annotations

from services.trainer.update import OptimizerOptions, UpdateOptions
from services.trainer.worker import WorkerOptions


def worker_options_from_config(cfg, role: str = "actor", *, hf_dir: str | None = None) -> tuple[WorkerOptions, float]:
    """(WorkerOptions, kl_coef) for `role` ("actor" or "reference") from an RLFabricConfig."""
    if role not in ("actor", "reference"):
        raise ValueError(f"role must be 'actor' or 'reference', got {role!r}")
    mt = cfg.actor_config if role == "actor" else cfg.ref_config
    rl = cfg.rl_config
    n = rl.n_samples_per_prompt
    hf_dir = hf_dir or mt.tokenizer_name_or_path
    load = mt.load
    if role == "reference":
        from services.trainer.checkpoint import reference_load_path

        ref_path = rl.integrated_mode_config.ref_model_load_path if rl.integrated_mode_config else None
        load = reference_load_path(load=mt.load, finetune=bool(mt.finetune), ref_model_load_path=ref_path)
    fwd = (rl.actor_forward_micro_batch_size if role == "actor" else rl.ref_forward_micro_batch_size) or mt.micro_batch_size
    warmup = int((mt.lr_warmup_fraction or 0.0) * (mt.train_iters or 0))
    update = UpdateOptions(
        micro_batch_size=mt.micro_batch_size or 1,
        mini_batch_rows=rl.mini_batch_size * n,
        epochs=rl.epochs,
        shuffle_mini_batch=rl.shuffle_mini_batch,
        seed=mt.seed,
        clip_ratio=rl.clip_ratio,
        clip_ratio_low=rl.clip_ratio_low if rl.clip_higher_enable else None,
        clip_ratio_high=rl.clip_ratio_high if rl.clip_higher_enable else None,
        kl_penalty=rl.kl_penalty,
        use_kl=cfg.derived.use_kl_loss,
        entropy_coeff=rl.entropy_coeff,
        token_level_loss=rl.token_level_loss,
    )
    optim = OptimizerOptions(
        lr=mt.lr if mt.lr is not None else 1e-6,
        min_lr=mt.min_lr,
        lr_decay_style=mt.lr_decay_style,
        lr_warmup_iters=warmup,
        train_iters=mt.train_iters or 1000,
        weight_decay=mt.weight_decay,
        adam_beta1=mt.adam_beta1,
        adam_beta2=mt.adam_beta2,
        clip_grad=mt.clip_grad,
    )
    opts = WorkerOptions(
        role=role,
        hf_dir=hf_dir,
        load=load,
        finetune=bool(mt.finetune) if role == "actor" else True,
        no_load_optim=bool(mt.no_load_optim),
        no_load_rng=bool(mt.no_load_rng),
        forward_micro_batch_size=fwd or 1,
        update=update,
        optimizer=optim,
        params_dtype="bfloat16" if mt.bf16 else "float32",
    )
    return opts, rl.init_kl_coef
