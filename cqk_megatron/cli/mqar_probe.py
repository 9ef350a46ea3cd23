"""``cqk mqar probe``: one run of the MQAR benchmark's setup with one thing changed.

    cqk mqar probe standard --family gpt2 --seed 0 --steps 2000
    cqk mqar probe standard --family gpt2 --megatron model.family=null \\
        model.normalization=LayerNorm model.position_embedding_type=learned_absolute \\
        model.add_bias_linear=true model.swiglu=true      # GPT-2 with SwiGLU instead of GELU
    cqk mqar probe invertible_differential --freeze-coupling

The run is ``eval.mqar.BENCHMARK``'s options on 64x4 (or ``--setting``) with the given
changes; ``--freeze-coupling`` trains everything but the coupling's parameters. It prints
the held-out curve as one line; nothing is written.
"""

from __future__ import annotations

import argparse

from cqk_megatron.cli.args import new_parser
from cqk_megatron.config import MODEL_FAMILIES, VARIANTS
from cqk_megatron.eval.mqar_options import POSITIONS


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "cqk mqar probe", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1]
    )
    parser.add_argument("variant", help=f"the attention variant, from {list(VARIANTS)}")
    parser.add_argument(
        "--family", default="llama", choices=list(MODEL_FAMILIES), help="model family"
    )
    parser.add_argument(
        "--position", default="pre_rope", choices=POSITIONS, help="coupling position"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--setting", default="64x4", help="SEQ_LENxNUM_KV_PAIRS")
    parser.add_argument("--steps", type=int, default=None, help="default: the benchmark's")
    parser.add_argument("--lr", type=float, default=None, help="default: the benchmark's")
    parser.add_argument("--eval-every", type=int, default=None, help="default: the benchmark's")
    parser.add_argument(
        "--megatron", nargs="*", default=[], help="RunConfig k=v overrides after the family's"
    )
    parser.add_argument(
        "--freeze-coupling",
        action="store_true",
        help="train everything but the coupling's parameters",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    from cqk_megatron.eval.mqar_data import MQARSetting
    from cqk_megatron.eval.mqar_probe import probe

    given = {"steps": args.steps, "lr": args.lr, "eval_every": args.eval_every}
    changes = {
        "family": args.family,
        "position": args.position,
        "seed": args.seed,
        "megatron": args.megatron,
        **{name: value for name, value in given.items() if value is not None},
    }
    torch.set_num_threads(1)
    setting = MQARSetting.parse(args.setting)
    result = probe(args.variant, setting, changes, freeze=args.freeze_coupling)
    curve = " ".join(f"{p['accuracy']:.2f}" for p in result["curve"])
    print(
        f"{args.variant} {args.family} seed {args.seed} {' '.join(args.megatron)}"
        f"{' frozen coupling' if args.freeze_coupling else ''}: accuracy "
        f"{result['accuracy']:.3f} after {result['steps']} steps, train loss "
        f"{result['final_train_loss']:.3f}, {result['train_cpu_seconds']:.0f} CPU s; "
        f"curve every {result['options']['eval_every']} steps: {curve}",
        flush=True,
    )
    return 0
