"""WorkerOptions from a MindSpeed-RL configuration (the only place that reads config for the trainer).

Values the config package derives (forward micro-batch sizes, params dtype, the reference's weights) are
read from `cfg.derived`, never re-derived here; the rule that a resumed run names its reference weights
is enforced when the config loads (services/common/config/resume.py).
"""

from __future__ import annotations

from services.trainer.update import OptimizerOptions, UpdateOptions
from services.trainer.worker import WorkerOptions


def worker_options_from_config(cfg, role: str = "actor", *, hf_dir: str | None = None) -> tuple[WorkerOptions, float]:
    """(WorkerOptions, kl_coef) for `role` ("actor" or "reference") from an RLFabricConfig."""
    if role not in ("actor", "reference"):
        raise ValueError(f"role must be 'actor' or 'reference', got {role!r}")
    actor = role == "actor"
    mt = cfg.actor_config if actor else cfg.ref_config
    rl, d = cfg.rl_config, cfg.derived
    warmup = int((mt.lr_warmup_fraction or 0.0) * (mt.train_iters or 0))
    update = UpdateOptions(
        micro_batch_size=mt.micro_batch_size or 1,
        mini_batch_rows=rl.mini_batch_size * rl.n_samples_per_prompt,
        epochs=rl.epochs,
        shuffle_mini_batch=rl.shuffle_mini_batch,
        seed=mt.seed,
        clip_ratio=rl.clip_ratio,
        clip_ratio_low=rl.clip_ratio_low if rl.clip_higher_enable else None,
        clip_ratio_high=rl.clip_ratio_high if rl.clip_higher_enable else None,
        kl_penalty=rl.kl_penalty,
        use_kl=d.use_kl_loss,
        entropy_coeff=rl.entropy_coeff,
        token_level_loss=rl.token_level_loss,
        is_cap=cfg.rlfabric.importance_sampling_cap,
        max_staleness=cfg.rlfabric.max_staleness,
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
        hf_dir=hf_dir or mt.tokenizer_name_or_path,
        load=mt.load if actor else d.ref_model_load_path,
        finetune=bool(mt.finetune) if actor else True,
        no_load_optim=bool(mt.no_load_optim),
        no_load_rng=bool(mt.no_load_rng),
        forward_micro_batch_size=(d.actor_forward_micro_batch_size if actor else d.ref_forward_micro_batch_size) or 1,
        update=update,
        optimizer=optim,
        params_dtype=d.params_dtype if actor else d.ref_params_dtype,
    )
    return opts, rl.init_kl_coef
