"""``cqk convert``: run checkpoints to Hugging Face folders and back.

cqk convert export CHECKPOINT_DIR OUT_DIR [--tokenizer PATH | --no-tokenizer]
    [--tokens-trained N] [--val-ppl X] [--license ID] [--datasets ID ...]
    [--base-model ID] [--dtype bfloat16] [--max-shard-size 5GB] [--force]
cqk convert import HF_DIR CHECKPOINT_DIR [--force]
"""

from __future__ import annotations

import argparse
import sys

from cqk_megatron.cli.args import HelpFormatter, add_force, new_parser
from cqk_megatron.convert.options import DEFAULT_MAX_SHARD, EXPORT_DTYPE_NAMES


def add_export_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="a run checkpoint (iter_XXXXXXX folder) -> a Hugging Face folder",
        description="Write a run checkpoint as a Hugging Face folder (safetensors, config,\n"
        "tokenizer, model card; remote code for the variants transformers does not have).",
        formatter_class=HelpFormatter,
    )
    export.add_argument(
        "checkpoint_dir",
        help="run_dir/checkpoints/iter_XXXXXXX (or the run or checkpoints folder: its newest "
        "checkpoint that verifies)",
    )
    export.add_argument("out_dir", help="the Hugging Face folder to write")
    tokenizer = export.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer", help="SentencePiece .model (default: the run's data.tokenizer)"
    )
    tokenizer.add_argument(
        "--no-tokenizer", action="store_true", help="export the weights without a tokenizer"
    )
    export.add_argument("--tokens-trained", type=int, help="tokens trained, for the model card")
    export.add_argument("--val-ppl", type=float, help="validation perplexity, for the model card")
    card = export.add_argument_group(
        "model card metadata (Hub identifiers; default: the run config's card.* fields)"
    )
    card.add_argument("--license", help="e.g. apache-2.0 (card.license)")
    card.add_argument(
        "--datasets",
        nargs="+",
        metavar="DATASET",
        help="the datasets it was trained on, e.g. HuggingFaceFW/fineweb (card.datasets)",
    )
    card.add_argument(
        "--base-model", help="the model it was trained from, e.g. org/name (card.base_model)"
    )
    export.add_argument(
        "--dtype", choices=EXPORT_DTYPE_NAMES, help="cast the weights (default: keep their dtype)"
    )
    export.add_argument(
        "--max-shard-size", default=DEFAULT_MAX_SHARD, help="split safetensors above this size"
    )
    add_force(
        export,
        "replace an existing out_dir (never a run folder, a checkpoint, or one holding or "
        "inside either)",
    )


def add_import_parser(commands: argparse._SubParsersAction) -> None:
    back = commands.add_parser(
        "import",
        help="a Hugging Face folder -> a run checkpoint for continued pretraining",
        description="Write a Hugging Face folder as a weights-only run checkpoint\n"
        "(train.init_from takes it).",
        formatter_class=HelpFormatter,
    )
    back.add_argument("hf_dir", help="a folder written by export, or a Llama-style model")
    back.add_argument(
        "checkpoint_dir", help="the weights-only checkpoint to write (for train.init_from)"
    )
    add_force(back, "replace an existing weights-only checkpoint (never a run's)")


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk convert",
        "Convert run checkpoints to Hugging Face and back.",
        epilog=__doc__.split("\n\n", 1)[1],
    )
    commands = parser.add_subparsers(dest="command", required=True, help="what to convert")
    add_export_parser(commands)
    add_import_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from cqk_megatron.convert.errors import ConversionError

    try:
        if args.command == "export":
            from cqk_megatron.convert.hf_export import export_checkpoint

            out = export_checkpoint(
                args.checkpoint_dir,
                args.out_dir,
                tokenizer=args.tokenizer,
                with_tokenizer=not args.no_tokenizer,
                tokens_trained=args.tokens_trained,
                validation_perplexity=args.val_ppl,
                license=args.license,
                datasets=args.datasets,
                base_model=args.base_model,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                overwrite=args.force,
            )
        else:
            from cqk_megatron.convert.hf_import import import_checkpoint

            out = import_checkpoint(args.hf_dir, args.checkpoint_dir, overwrite=args.force)
    except ConversionError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
