"""``cqk-convert``: run checkpoints to Hugging Face folders and back.

cqk-convert export CHECKPOINT_DIR OUT_DIR [--tokenizer PATH | --no-tokenizer]
    [--tokens-trained N] [--val-ppl X] [--license ID] [--datasets ID ...]
    [--base-model ID] [--dtype bfloat16] [--max-shard-size 5GB] [--overwrite]
cqk-convert import HF_DIR CHECKPOINT_DIR [--overwrite]
"""

from __future__ import annotations

import argparse
import sys

from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.convert.hf_export import EXPORT_DTYPES, export_checkpoint
from cqk_megatron.convert.hf_import import import_checkpoint
from cqk_megatron.convert.safetensors_io import DEFAULT_MAX_SHARD


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cqk-convert", description="Convert run checkpoints to Hugging Face and back."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser(
        "export", help="a run checkpoint (iter_XXXXXXX folder) -> a Hugging Face folder"
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
    export.add_argument("--tokens-trained", type=int, help="for the model card")
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
        "--dtype", choices=list(EXPORT_DTYPES), help="cast the weights (default: keep)"
    )
    export.add_argument(
        "--max-shard-size", default=DEFAULT_MAX_SHARD, help="split safetensors above this size"
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing out_dir (never a run folder, a checkpoint, or one holding "
        "or inside either)",
    )

    back = commands.add_parser(
        "import", help="a Hugging Face folder -> a run checkpoint for continued pretraining"
    )
    back.add_argument("hf_dir", help="a folder written by export, or a Llama-style model")
    back.add_argument(
        "checkpoint_dir", help="the weights-only checkpoint to write (for train.init_from)"
    )
    back.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing weights-only checkpoint (never a run's)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
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
                overwrite=args.overwrite,
            )
        else:
            out = import_checkpoint(args.hf_dir, args.checkpoint_dir, overwrite=args.overwrite)
    except ConversionError as error:
        print(f"cqk-convert {args.command}: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
