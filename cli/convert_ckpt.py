"""MindSpeed-RL's (MindSpeed-LLM's) `python cli/convert_ckpt.py ...` as a thin alias of `rlfabric convert`.

    python cli/convert_ckpt.py --use-mcore-models --model-type GPT --load-model-type hf --save-model-type mg \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 --add-qkv-bias \\
        --load-dir ./Qwen2.5-7B --save-dir ./ckpt --tokenizer-model ./Qwen2.5-7B/tokenizer.json \\
        --model-type-hf llama2 --params-dtype bf16
    ->  rlfabric convert hf2mcore --tp 2 --pp 2 ./Qwen2.5-7B ./ckpt

hf -> mg writes the checkpoint at --save-dir; mg -> hf writes `--save-dir/mg2hf` when --save-dir is the original
Hugging Face folder (upstream's layout; its config and tokenizer files are taken from there), else a complete
Hugging Face folder at --save-dir. rlfabric reads the architecture from the model's config.json, so for hf -> mg
the flags that describe it upstream (--model-type-hf, --add-qkv-bias, --params-dtype) are checked against that file
and a disagreement is refused, never ignored (mg -> hf reads the architecture the checkpoint carries, and the
target sizes do not apply to an HF folder, as upstream); flags of features the converter does not have are
refused by name. `--iteration N` (mg -> hf) is rlfabric's: which saved iteration to convert (default the latest).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# upstream --model-type-hf -> the config.json model_type values its handler converts (Qwen2.5 goes through llama2)
MODEL_TYPES_HF = {"llama2": ("llama", "qwen2"), "qwen3": ("qwen3",), "qwen3-moe": ("qwen3_moe",)}
DTYPE_BITS = {"fp32": 32, "float32": 32, "bf16": 16, "bfloat16": 16, "fp16": 16, "float16": 16}
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}
PROG = "cli/convert_ckpt.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as every rlfabric usage mistake
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                allow_abbrev=False)
    p.add_argument("--use-mcore-models", action="store_true", help="required: rlfabric writes Megatron-core only")
    p.add_argument("--model-type", default="GPT", help="GPT (the only model type)")
    p.add_argument("--load-model-type", required=True, choices=("hf", "mg"), help="format of --load-dir")
    p.add_argument("--save-model-type", required=True, choices=("hf", "mg"), help="format of --save-dir")
    p.add_argument("--load-dir", required=True, help="the folder to convert")
    p.add_argument("--save-dir", required=True, help="where the result goes (mg -> hf: the original HF folder)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="hf -> mg: TP of the checkpoint")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="hf -> mg: PP of the checkpoint")
    p.add_argument("--target-expert-parallel-size", type=int, default=1, help="hf -> mg: EP (MoE models)")
    p.add_argument("--model-type-hf", default="llama2", help=f"checked against config.json: {', '.join(MODEL_TYPES_HF)}")
    p.add_argument("--add-qkv-bias", action="store_true", help="checked against config.json (Qwen2: yes)")
    p.add_argument("--tokenizer-model", default=None, help="checked to exist; tokenizer files come from the HF folder")
    p.add_argument("--params-dtype", default=None, help="fp32, bf16 or fp16: checked against the weights' dtype")
    p.add_argument("--iteration", type=int, default=None, help="mg -> hf: iteration to convert (default: latest)")
    return p


def _refuse(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _check_hf_flags(args: argparse.Namespace, hf_dir: Path) -> str | None:
    """The upstream flags that describe the model, against its config.json: a message for the first that disagrees."""
    config = hf_dir / "config.json"
    if not config.is_file():
        return f"{hf_dir} has no config.json; --load-dir must be a Hugging Face model folder for --load-model-type hf"
    raw = json.loads(config.read_text())
    model_type = raw.get("model_type", "")
    handled = MODEL_TYPES_HF.get(args.model_type_hf)
    if handled is None:
        supported = ", ".join(f"{name} ({'/'.join(types)})" for name, types in MODEL_TYPES_HF.items())
        return f"--model-type-hf {args.model_type_hf} is not converted by rlfabric; supported: {supported}"
    if model_type not in handled:
        return f"--model-type-hf {args.model_type_hf} converts {'/'.join(handled)} models; {config} says {model_type!r}"
    bias = model_type == "qwen2" or bool(raw.get("attention_bias", False))
    if args.add_qkv_bias != bias:
        return (f"{config} has {'a' if bias else 'no'} q/k/v bias: {'add' if bias else 'drop'} --add-qkv-bias "
                f"(upstream would {'drop the bias weights' if bias else 'expect bias weights that are not there'})")
    if args.params_dtype is not None:
        if args.params_dtype not in DTYPE_BITS:
            return f"--params-dtype {args.params_dtype}: choose fp32, bf16 or fp16"
        stored = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        wanted = DTYPE_NAMES[args.params_dtype]
        if wanted != stored and DTYPE_BITS[args.params_dtype] <= DTYPE_BITS.get(stored, 32):
            return (f"--params-dtype {args.params_dtype}: {hf_dir} holds {stored} weights and rlfabric's converter "
                    f"keeps them as they are (the trainer casts them to the run's dtype when it loads), so it "
                    f"cannot round them to {wanted} as upstream would; drop the flag or give "
                    f"--params-dtype {'fp32' if stored == 'float32' else stored}")
    if args.tokenizer_model and not Path(args.tokenizer_model).exists():
        return f"--tokenizer-model {args.tokenizer_model}: not found (the tokenizer files are taken from --load-dir)"
    return None


def to_rlfabric(args: argparse.Namespace) -> list[str] | str:
    """The `rlfabric` argv for upstream's flags, or a message saying why they cannot be honoured."""
    if not args.use_mcore_models:
        return "rlfabric writes Megatron-core (mcore) checkpoints only: add --use-mcore-models"
    if args.model_type != "GPT":
        return f"--model-type {args.model_type}: only GPT models are converted"
    direction = (args.load_model_type, args.save_model_type)
    if direction == ("hf", "mg"):
        problem = _check_hf_flags(args, Path(args.load_dir))
        if problem:
            return problem
        return ["convert", "hf2mcore", "--tp", str(args.target_tensor_parallel_size),
                "--pp", str(args.target_pipeline_parallel_size), "--ep", str(args.target_expert_parallel_size),
                args.load_dir, args.save_dir]
    if direction == ("mg", "hf"):
        # The checkpoint's own TP/PP are read from it; upstream's target sizes do not apply to an HF folder.
        save = Path(args.save_dir)
        argv = ["convert", "mcore2hf", args.load_dir]
        if (save / "config.json").is_file():  # upstream: the original HF folder; the weights go to its mg2hf/
            argv += [str(save / "mg2hf"), "--hf-assets", str(save)]
        else:
            argv.append(str(save))
        return argv + ([] if args.iteration is None else ["--iteration", str(args.iteration)])
    return (f"--load-model-type {args.load_model_type} --save-model-type {args.save_model_type}: rlfabric converts "
            f"hf -> mg and mg -> hf; to change a checkpoint's TP/PP, convert it to hf and back")


def main(argv: list[str] | None = None) -> int:
    args, unknown = _parser().parse_known_args(argv)
    if unknown:
        flags = [a for a in unknown if a.startswith("-")] or unknown
        return _refuse(f"{flags[0]} is not supported by rlfabric's converter (it converts dense and Qwen3-MoE models "
                       f"between HF and mcore layouts; no LoRA, virtual pipeline or layer-list options)")
    target = to_rlfabric(args)
    if isinstance(target, str):
        return _refuse(target)
    from services.cli import main as rlfabric

    return rlfabric(target)


if __name__ == "__main__":
    sys.exit(main())
