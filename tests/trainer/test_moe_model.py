"""The trainer's Qwen3-MoE on Megatron-core's MoELayer (tests/trainer/moe_checks.py, two gloo ranks), against
transformers in fp32: log-probs equal HF's at expert parallel 1 and 2 (EP 2 with both token dispatchers; the two
data-parallel ranks' micro-batches hold different token counts), and one backward at EP 2 gives the gradients of
EP 1 (the same data-parallel split, aux loss on), which for the weights the aux loss does not reach (every
expert) equal HF's plain-torch gradients. Plus the routing configuration and the MoE metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_log_probs
from moe_checks import TEMPERATURE
from rank_checks import make_rows
from routing_reference import hf_forced_log_probs
from trainer_helpers import run_ranks

from services.common.model_spec import check_expert_parallel, read_hf_config

CASES = ("1:allgather", "2:allgather", "2:alltoall")


@pytest.fixture(scope="module")
def moe_results(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{"EP:DISPATCHER": rank 0's results} (moe_checks.py)."""
    work = tmp_path_factory.mktemp("moe_work")
    cases = [arg for case in CASES for arg in ("--case", case)]
    run_ranks("moe_checks.py", 2, ["--hf", str(tiny_moe_dir), "--work", str(work), *cases], timeout_s=300)
    return {case: torch.load(work / f"moe_ep{case.replace(':', '_')}.pt", weights_only=False) for case in CASES}


@pytest.fixture(scope="module")
def hf_model(tiny_moe_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", CASES)
def test_log_probs_equal_transformers(moe_results, hf_model, case: str) -> None:
    rows = make_rows(hf_model.config.vocab_size, 1)
    expected = hf_log_probs(hf_model, rows, TEMPERATURE)
    got = moe_results[case]["log_probs"]
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_replaying_the_routers_own_experts_is_exact(moe_results, case: str) -> None:
    """Routing replay of the experts the routers choose themselves (HF's choice), or of free rows only, gives the
    log-probs of the plain forward bitwise."""
    plain, replay = moe_results[case]["log_probs"], moe_results[case]["replay"]
    assert torch.equal(replay["own"], plain)
    assert torch.equal(replay["free"], plain)


@pytest.mark.parametrize("case", CASES)
def test_replayed_routing_equals_a_forward_forced_to_those_experts(moe_results, hf_model, case: str) -> None:
    replay = moe_results[case]["replay"]
    rows = make_rows(hf_model.config.vocab_size, 1)
    forced = hf_forced_log_probs(hf_model, rows, replay["routing"], TEMPERATURE)
    assert (replay["forced"] - forced).abs().max().item() < 1e-5
    assert (replay["forced_packed"] - forced).abs().max().item() < 1e-5
    # ... and the replay really moved the experts: random routing is far from the routers' own.
    assert (replay["forced"] - moe_results[case]["log_probs"]).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", ["2:allgather", "2:alltoall"])
def test_ep2_gradients_equal_ep1(moe_results, case: str) -> None:
    g1, g2 = moe_results["1:allgather"]["grads"], moe_results[case]["grads"]
    assert set(g1) == set(g2) and len(g1) > 16
    experts = [n for n in g1 if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 2  # layers x experts x (fc1, fc2): every expert's gradient came back
    diffs = {n: (g1[n] - g2[n]).abs().max().item() for n in g1}
    assert max(diffs.values()) < 1e-6, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    assert max(g.abs().max().item() for g in g1.values()) > 1e-3  # the step did produce gradients


def test_expert_gradients_equal_plain_torch(moe_results, hf_model) -> None:
    """The last layer's experts get no gradient from any aux loss (each layer's aux loss depends on its router's
    input, which earlier layers' experts produce), so theirs is the NLL's alone: HF's in plain torch."""
    from services.trainer import grpo_loss

    rows = make_rows(hf_model.config.vocab_size, 1)
    model = hf_model.train()
    model.zero_grad(set_to_none=True)
    # moe_checks: per DP rank (4 rows each), micro-batches of 2 rows, token-mean NLL per micro-batch, mean over
    # the 2 micro-batches, mean over the 2 DP ranks: each micro-batch weighs 1/4.
    for m in range(4):
        idx = [2 * m, 2 * m + 1]
        logps = []
        for i in idx:
            seq = rows.token_ids[rows.seq_offsets[i]: rows.seq_offsets[i + 1]]
            p = int(rows.prompt_lengths[i])
            logits = model(seq[None]).logits[:, p - 1: len(seq) - 1]
            lp, _ = grpo_loss.compute_log_probs(logits, seq[None, p:], TEMPERATURE)
            logps.append(lp[0])
        flat = torch.cat(logps)
        (-flat.mean() / 4).backward()
    model.eval()
    got = moe_results["2:allgather"]["grads"]
    params = dict(model.named_parameters())
    for layer in (1,):
        for e in range(8):
            hf = f"model.layers.{layer}.mlp.experts."
            gate_up = params[hf + "gate_up_proj"].grad[e]  # transformers 5 keeps the experts fused: [E, 2F, H]
            down = params[hf + "down_proj"].grad[e]
            assert (got[f"{hf}{e}.linear_fc1"] - gate_up).abs().max().item() < 1e-6
            assert (got[f"{hf}{e}.linear_fc2"] - down).abs().max().item() < 1e-6


def test_moe_metrics_report_aux_loss_and_expert_load(moe_results) -> None:
    for case in CASES:
        fwd, upd = moe_results[case]["forward_metrics"], moe_results[case]["update_metrics"]
        assert "moe/aux_loss" not in fwd  # log-prob passes run no aux loss
        assert fwd["moe/expert_load_max_over_mean"] >= 1.0 and upd["moe/expert_load_max_over_mean"] >= 1.0
        # Switch aux loss (without its coefficient): E * sum_e f_e * P_e, 1.0 when perfectly balanced.
        assert 0.9 < upd["moe/aux_loss"] < 3.0
    # The same tokens and weights at EP 1 and 2: the same metrics.
    for case in CASES[1:]:
        for kind in ("update_metrics", "forward_metrics"):
            assert moe_results[case][kind] == pytest.approx(moe_results[CASES[0]][kind], rel=1e-6)


def test_router_config_matches_hf_routing(tiny_moe_dir: Path) -> None:
    """HF: softmax over all experts, top-k, renormalised when norm_topk_prob; Megatron's equivalent flags."""
    import dataclasses

    from services.trainer import moe

    spec, _ = read_hf_config(tiny_moe_dir)
    kw = moe.transformer_config_kwargs(spec, moe.MoeOptions(moe_aux_loss_coeff=0.001), ep=2)
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 64
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top-k logits
    assert kw["moe_layer_freq"] == [1, 1] and kw["expert_model_parallel_size"] == 2
    assert kw["expert_tensor_parallel_size"] is None  # Megatron's default: the TP size
    assert kw["moe_expert_capacity_factor"] is None and kw["moe_shared_expert_intermediate_size"] is None
    assert kw["moe_aux_loss_coeff"] == 0.001 and kw["moe_grouped_gemm"] is False
    unnormed = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, norm_topk_prob=False, moe_layers=(1,)))
    kw = moe.transformer_config_kwargs(unnormed, moe.MoeOptions(), ep=1)
    assert kw["moe_router_pre_softmax"] is True and kw["moe_layer_freq"] == [0, 1]
    assert moe.transformer_config_kwargs(dataclasses.replace(spec, moe=None), moe.MoeOptions(), ep=1) == {}


def test_expert_parallel_and_options_refuse_bad_values(tiny_moe_dir: Path) -> None:
    import dataclasses

    from services.trainer import moe

    spec, _ = read_hf_config(tiny_moe_dir)
    with pytest.raises(ValueError, match="expert parallel size 3 must divide num_experts=8"):
        check_expert_parallel(spec, ep=3)
    with pytest.raises(ValueError, match="expert tensor parallel size 3 must divide moe_intermediate_size=64"):
        check_expert_parallel(spec, ep=2, etp=3)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_expert_parallel(dataclasses.replace(spec, moe=None), ep=2)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type 'flex'"):
        moe.MoeOptions(moe_token_dispatcher_type="flex")
    with pytest.raises(ValueError, match="moe_router_load_balancing_type 'sinkhorn'"):
        moe.MoeOptions(moe_router_load_balancing_type="sinkhorn")


def test_expert_load_ratio_is_the_worst_layers_max_over_mean() -> None:
    from services.trainer.moe import _max_over_mean

    counts = torch.tensor([[2.0, 2.0, 2.0, 2.0], [6.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert _max_over_mean(counts) == pytest.approx(3.0)  # layer 1: 6 / 2; layer 2 saw no tokens
    assert _max_over_mean(torch.zeros(0, 8)) == 0.0


def test_moe_options_follow_the_yaml_keys() -> None:
    from types import SimpleNamespace

    from services.trainer.options import moe_options_from_config

    mt = SimpleNamespace(moe_aux_loss_coeff=0.02, moe_router_load_balancing_type="seq_aux_loss",
                         moe_token_dispatcher_type=None, moe_router_enable_expert_bias=True)
    opts = moe_options_from_config(mt)
    assert (opts.moe_aux_loss_coeff, opts.moe_router_load_balancing_type) == (0.02, "seq_aux_loss")
    assert opts.moe_router_enable_expert_bias is True
    assert opts.moe_token_dispatcher_type == "allgather"  # unset: Megatron's default
    mt.moe_token_dispatcher_type = "alltoall_seq"  # MindSpeed's; megatron-core's alltoall replaced it
    assert moe_options_from_config(mt).moe_token_dispatcher_type == "alltoall"
