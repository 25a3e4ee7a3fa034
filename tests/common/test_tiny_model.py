"""`rlfabric tiny-model` writes a model that transformers and vLLM load and decode identically (greedy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

PROMPTS = ["What is 12 + 34? The answer is", "<|im_start|>user\nSolve x<|im_end|>\n<|im_start|>assistant\n"]
MAX_NEW = 24

VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        model, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    """
)


def test_cli_writes_a_loadable_model(tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "tiny-model", str(out), "--seed", "3"],
                          cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == 4096 and config["tie_word_embeddings"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 4096
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 5e6


def test_same_seed_same_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from services.common.tiny_model import write_tiny_model

    a = load_file(write_tiny_model(tmp_path / "a", seed=1, num_layers=1) / "model.safetensors")
    b = load_file(write_tiny_model(tmp_path / "b", seed=1, num_layers=1) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


# Soak: a plain vLLM `LLM` of its own (~45 s); in CI, tests/rollout/test_generate.py checks the same equality on the
# session's engine through the rollout service.
@pytest.mark.slow
def test_vllm_and_transformers_greedy_tokens_are_identical(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            expected.append(out[0, len(ids):].tolist())

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "OMP_NUM_THREADS": "1"}
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir), json.dumps(prompts), str(MAX_NEW)],
                          capture_output=True, text=True, env=env, timeout=600)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stderr[-3000:]
    got = json.loads(result[0].removeprefix("RESULT "))
    assert [len(g) for g in got] == [MAX_NEW] * len(PROMPTS)
    assert got == expected


def test_single_digits_give_one_token_per_digit(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from services.common.tiny_model import write_tiny_model

    out = write_tiny_model(tmp_path / "digits", vocab_size=512, num_layers=1, digits="single")
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 512 and json.loads((out / "config.json").read_text())["vocab_size"] == 512
    ids = tok("12+340=352<|im_end|>")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "+", "3", "4", "0", "=", "3", "5", "2", "<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "12+340=352"

