"""`rlfabric preprocess CONFIG.yaml`: MindSpeed-RL dataset preprocessing from a dataset YAML.

Also runnable as `python -m services.data.cli CONFIG.yaml`, which is what
`examples/data/preprocess_data.sh NAME` calls. Progress goes to stderr (every `log_interval` rows), the final
summary to stdout. Bad input exits with status 2 and one message naming the file, row, key or field.
"""

from __future__ import annotations

import argparse
import logging
import sys

_DESCRIPTION = (
    "Tokenises a dataset with a chat template and writes Megatron indexed datasets "
    "{output_prefix}_packed_{input_ids,attention_mask,labels}_document.{bin,idx}, as MindSpeed-RL's "
    "preprocess_data.py does. Keys come from the YAML (configs/datasets/*.yaml); --set overrides one key "
    "without editing the file."
)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("preprocess", help="tokenise a dataset into Megatron indexed datasets",
                              description=_DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(func=run_preprocess)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="dataset YAML, e.g. configs/datasets/deepscaler.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a YAML key (value parsed as YAML), e.g. --set input=../shared/data/x.json; "
                        "repeatable")
    p.add_argument("--summary-json", metavar="PATH", help="also write the run summary as JSON to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only the summary and errors")


def run_preprocess(args: argparse.Namespace) -> int:
    import json
    import signal

    from services.common.errors import DataError
    from services.data.dataset_config import load_dataset_config
    from services.data.preprocess import preprocess

    if not args.quiet:
        logging.getLogger("services.data").setLevel(logging.INFO)

    def _on_sigterm(signum: int, frame: object) -> None:
        # Turn SIGTERM into an exception so the temporary output is removed on the way out.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        config = load_dataset_config(args.config, args.overrides)
        summary = preprocess(config)
    except DataError as exc:
        print(f"rlfabric preprocess: error: {exc}", file=sys.stderr)
        if "not found" in str(exc):
            print("rlfabric preprocess: hint: the YAML's paths can be changed without editing it, e.g. "
                  "--set input=PATH --set tokenizer_name_or_path=DIR --set output_prefix=PREFIX", file=sys.stderr)
        return 2
    print(summary.format())
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary.to_dict(), fh, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfabric preprocess", description=_DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_preprocess(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
