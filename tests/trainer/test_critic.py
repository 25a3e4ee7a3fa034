"""PPO's critic in the trainer (services/trainer/value_head.py, critic.py): a TrainerWorker with role "critic" on the
tiny model (tests/trainer/critic_checks.py, gloo ranks). Its values are the value head at the positions whose logits
predict each response token, equal to a plain-torch computation on the HF model's final hidden states with the
same head; they do not depend on TP, sequence parallelism or DP; updates lower the clipped value loss on a fixed
batch; checkpoints resume exactly; weights without a head (HF, the actor's checkpoint) start a fresh head, as
upstream's critic starts from the actor's weights. Also the critic's options from a PPO config."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import run_ranks

from services.common.config import load_config
from services.trainer.options import worker_options_from_config
from services.trainer.value_head import attach_value_head, is_head_name

STD = 0.02  # critic_checks.STD
HEAD_KEYS = ["value_head.bias", "value_head.weight"]
PPO = ["megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae", "critic_config.lr=5e-6",
       "critic_config.micro_batch_size=2"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from services.common.tiny_model import write_tiny_model

    work = tmp_path_factory.mktemp("critic")
    untied = write_tiny_model(work / "untied", tie_word_embeddings=False)
    run_ranks("critic_checks.py", 1, ["--hf", str(tiny_model_dir), "--work", str(work), "--untied", str(untied),
                                      "--layout", "tp1"])
    run_ranks("critic_checks.py", 2, ["--hf", str(tiny_model_dir), "--work", str(work), "--layout", "tp2",
                                      "--layout", "tp2sp", "--layout", "dp2"])
    return {name: torch.load(work / f"critic_{name}.pt", weights_only=False) for name in ("tp1", "tp2", "tp2sp", "dp2")}


def reference_values(model_dir: Path, rows: tuple, head: dict, shift: int = 0) -> np.ndarray:
    """The head on the HF model's final (normed) hidden states at positions prompt - 1 + t (+ shift), in float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, prompts, responses = rows
    out, start = [], 0
    for p, r in zip(prompts.tolist(), responses.tolist(), strict=True):
        ids = tokens[start : start + p + r]
        start += p + r
        with torch.no_grad():
            hidden = model.model(ids[None]).last_hidden_state[0]
        pos = torch.arange(p - 1, p + r - 1) + shift
        out.append((hidden[pos.clamp(max=p + r - 1)].float() @ head["weight"].T + head["bias"])[:, 0].numpy())
    return np.concatenate(out)


def test_the_head_is_in_the_state_dict_and_the_optimizer_and_starts_as_upstreams(runs):
    r = runs["tp1"]
    assert r["state_keys"] == HEAD_KEYS and set(HEAD_KEYS) <= set(r["optimizer_names"])
    w, b = r["head"]["weight"], r["head"]["bias"]
    assert w.shape == (1, 128) and w.dtype == b.dtype == torch.float32
    assert torch.equal(b, torch.zeros(1)) and abs(w.std().item() - STD) < 0.005 and abs(w.mean().item()) < 0.006
    # drawn from the critic's seed: every build (every rank, every restart) starts from the same head
    assert all(torch.equal(r["head"][k], r["head_again"][k]) for k in ("weight", "bias"))
    assert r["raw_output_shape"][0] == 1 and r["raw_output_shape"][2] == 1  # [b, S, 1]: a value per position


def test_values_are_the_head_at_the_positions_that_predict_each_response_token(runs, tiny_model_dir: Path):
    r = runs["tp1"]
    got = r["values"].numpy()
    assert got.dtype == np.float32 and got.shape == (int(r["rows"][2].sum()),)
    expected = reference_values(tiny_model_dir, r["rows"], r["head"])
    assert np.abs(got - expected).max() < 1e-5
    # one position later reads other hidden states: the comparison above pins the positions
    assert np.abs(got - reference_values(tiny_model_dir, r["rows"], r["head"], shift=1)).max() > 1e-3
    # packed rows and token-budget micro-batches give the padded layout's values
    assert torch.allclose(r["values_packed"], r["values"], atol=1e-6)
    assert torch.allclose(r["values_dynamic"], r["values"], atol=1e-6)


@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "dp2"])
def test_values_and_an_update_do_not_depend_on_the_layout(runs, layout: str):
    one, other = runs["tp1"]["layout"], runs[layout]
    assert all(torch.equal(one["head"][k], other["head"][k]) for k in ("weight", "bias"))
    assert torch.allclose(other["values"], one["values"], atol=1e-5)
    m1, m2 = one["metrics"], other["metrics"]
    assert m2["critic/vf_loss"] == pytest.approx(m1["critic/vf_loss"], rel=1e-5)
    assert m2["critic/vf_clipfrac"] == m1["critic/vf_clipfrac"]
    # the gradient norm counts the head (replicated over TP) once, and the backbone as the actor's
    assert m2["critic/grad_norm"] == pytest.approx(m1["critic/grad_norm"], rel=1e-4)
    assert torch.allclose(other["values_after"], one["values_after"], atol=1e-4)
    assert (one["values_after"] - one["values"]).abs().max() > 1e-3  # the update moved the values


def test_updates_lower_the_value_loss_on_a_fixed_batch(runs):
    r = runs["tp1"]
    losses = r["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < 0.8 * losses[0], losses
    m = r["update_metrics"][0]
    assert {k for k in m if not k.startswith("memory/")} == {
        "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr", "timing/update_critic"}
    assert {k for k in m if k.startswith("memory/")} and all(k.startswith("memory/critic/") for k in m
                                                             if k.startswith("memory/"))
    assert m["critic/lr"] == pytest.approx(2e-4) and m["critic/grad_norm"] > 0
    assert m["critic/vf_loss"] == pytest.approx(losses[0], rel=1e-5)  # vf_loss is the loss before the step
    assert r["weights_version"] == 5
    moved = set(r["moved"])
    assert set(HEAD_KEYS) <= moved and "embedding.word_embeddings.weight" in moved
    assert "decoder.final_layernorm.weight" in moved and any(k.startswith("decoder.layers.0.") for k in moved)


def test_a_critic_checkpoint_resumes_exactly(runs):
    r = runs["tp1"]
    assert r["saved_head_keys"] == HEAD_KEYS and r["saved_optimizer_has_head"]
    assert r["resumed_iteration"] == 2 and r["resumed_values_equal"]
    assert r["resume_max_abs_diff"] == 0.0


def test_weights_without_a_head_start_a_fresh_one(runs):
    r = runs["tp1"]
    assert r["from_actor_backbone_equal"] and r["from_actor_head_fresh"]
    assert r["trained_head_moved"] and r["reloaded_head_fresh"] and r["reset_is_fresh"]
    assert r["actor_optimizer_refusal"] is not None and "no value head" in r["actor_optimizer_refusal"]
    assert "no_load_optim" in r["actor_optimizer_refusal"] and r["no_load_optim_ok"]


def test_an_untied_output_layer_stays_frozen_and_out_of_the_optimizer(runs):
    r = runs["tp1"]
    assert not r["untied_output_layer_trainable"] and not r["untied_output_layer_in_optimizer"]
    assert r["untied_output_layer_unchanged"] and r["untied_grad_norm"] > 0


def test_pipeline_parallel_with_tied_embeddings_is_refused():
    config = types.SimpleNamespace(pipeline_model_parallel_size=2, hidden_size=8)
    model = types.SimpleNamespace(config=config, share_embeddings_and_output_weights=True, post_process=True)
    with pytest.raises(ValueError, match="untied embeddings.*PP 1"):
        attach_value_head(model, init_std=0.02, seed=1)
    assert is_head_name("value_head.weight") and is_head_name("module.value_head.bias")
    assert not is_head_name("output_layer.weight") and not is_head_name("decoder.value_heads.x")


def test_critic_options_come_from_critic_config_and_rl_config(repo_root: Path):
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[
        *PPO, "critic_config.load=/ckpt/actor", "critic_config.finetune=true", "critic_config.no_load_optim=true",
        "critic_config.seed=7", "critic_config.init_method_std=0.03", "critic_config.clip_grad=0.5",
        "rl_config.cliprange_value=0.3", "rl_config.epochs=2", "rl_config.use_dynamic_bsz=true",
        "rl_config.max_packing_token_size=2048", "rl_config.update_max_packing_token_size=999"])
    opts, _ = worker_options_from_config(cfg, "critic")
    assert (opts.role, opts.load, opts.finetune, opts.no_load_optim) == ("critic", "/ckpt/actor", True, True)
    assert opts.hf_dir == cfg.critic_config.tokenizer_name_or_path and opts.params_dtype == "float32"
    assert opts.forward_micro_batch_size == opts.update.micro_batch_size == 2
    assert opts.update.mini_batch_rows == cfg.rl_config.mini_batch_size * cfg.rl_config.n_samples_per_prompt
    assert (opts.update.epochs, opts.update.seed, opts.update.cliprange_value) == (2, 7, 0.3)
    assert opts.update.packing.max_tokens == opts.forward_packing.max_tokens == 2048  # not the actor's update_ budget
    assert (opts.optimizer.lr, opts.optimizer.clip_grad, opts.init_method_std) == (5e-6, 0.5, 0.03)
    assert opts.lora is None
    actor, _ = worker_options_from_config(cfg, "actor")
    assert actor.optimizer.lr == cfg.actor_config.lr != opts.optimizer.lr
    bf16 = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[*PPO, "critic_config.bf16=true"])
    assert bf16.derived.params_dtype == "float32"  # the actor's view stays float32
    assert worker_options_from_config(bf16, "critic")[0].params_dtype == "bfloat16"


def test_a_critic_without_critic_config_is_refused(repo_root: Path):
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml")
    assert cfg.critic_config is None
    with pytest.raises(ValueError, match="critic_config"):
        worker_options_from_config(cfg, "critic")
    with pytest.raises(ValueError, match="role must be one of"):
        worker_options_from_config(cfg, "judge")
