"""GPU check: bf16 training steps of the 350M and 1B configs on one H100/H200.

    python tests/gpu/check.py [--configs configs/models/350m.yaml,configs/models/1b.yaml]
        [--variants standard,coupled,coupled@compiled,differential] [--steps 10] [--warmup 3]
        [--micro-batch 8,4] [--seq 2048] [--budget-s 540] [--out gpu_check.json]
        [--dry-run] [--allow-cpu]

Runs in one go, within 10 minutes, on a single GPU; CI never runs it (pytest does not
collect it: the file name does not start with ``test_``, and ``conftest.py`` here
ignores the folder). It reports:

1. Which SDPA kernels serve each attention shape: the raw kernel for queries and values
   of ``head_dim`` (and values of ``2 head_dim``, differential attention's), each
   backend alone, then one forward + backward of every variant's attention layer with
   SDPA restricted to flash + cuDNN. Standard and coupled attention must pass.
2. For each config: bf16 training steps (forward, backward, AdamW) of every variant,
   interleaved, via ``cqk_megatron.perf.bench``: tokens/s, MFU (model FLOPs over the
   GPU's dense bf16 peak), peak step memory, activation memory against the planner's
   estimate, and each variant's step-time ratio to standard (coupled's target: <= 1.05).

``--dry-run`` parses the arguments, prints the plan (with the planner's memory
estimate for each config on this GPU size) and exits: it needs no GPU.
Exit status: 0 if every required check passed, 1 if one failed, 2 if it cannot run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

DEFAULT_CONFIGS = "configs/models/350m.yaml,configs/models/1b.yaml"
DEFAULT_MICRO_BATCHES = "8,4"  # tokens per step: 16k at 350M, 8k at 1B (seq 2048)
REQUIRED_FLASH_VARIANTS = ("standard", "coupled")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated YAML paths")
    parser.add_argument("--variants", default="standard,coupled,coupled@compiled,differential")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds per config")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per config")
    parser.add_argument(
        "--micro-batch", default=DEFAULT_MICRO_BATCHES, help="one per config, comma-separated"
    )
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=540, help="skip configs after this")
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    parser.add_argument("--gpu-mem", default=None, help="dry run: GPU memory (default 80GiB)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from cqk_megatron.perf.bench import split_variant

    parser = build_parser()
    args = parser.parse_args(argv)
    args.config_list = [c for c in args.configs.split(",") if c]
    args.variant_list = [v for v in args.variants.split(",") if v]
    for variant in args.variant_list:
        try:
            split_variant(variant)  # a variant name, optionally @compiled/@recompute tagged
        except ValueError as error:
            parser.error(f"--variants: {error}")
    if "standard" not in args.variant_list:
        parser.error("--variants must include standard, the baseline of every ratio")
    try:
        args.micro_batches = [int(b) for b in args.micro_batch.split(",")]
    except ValueError:
        parser.error(f"--micro-batch {args.micro_batch!r}: integers, comma-separated")
    if len(args.micro_batches) == 1:
        args.micro_batches *= len(args.config_list)
    if len(args.micro_batches) != len(args.config_list):
        parser.error(
            f"--micro-batch gives {len(args.micro_batches)} values for "
            f"{len(args.config_list)} configs; give one, or one per config"
        )
    for name in args.config_list:
        if name != "tiny" and not (REPO / name).is_file() and not Path(name).is_file():
            parser.error(f"--configs: {name} does not exist")
    if args.steps < 1 or args.warmup < 0 or args.seq < 1:
        parser.error("--steps and --seq must be positive, --warmup non-negative")
    return args


def load(name: str, seq: int):
    from cqk_megatron.perf.bench import load_bench_config

    path = name if name == "tiny" or Path(name).is_file() else str(REPO / name)
    return load_bench_config(path, [f"model.seq_length={seq}", "train.precision=bf16"])


def print_plan(args: argparse.Namespace) -> None:
    from cqk_megatron.perf.bench import variant_of
    from cqk_megatron.perf.flops import flops_per_token
    from cqk_megatron.perf.memory import total_parameters
    from cqk_megatron.perf.plan import Layout, gib, parse_bytes, plan_layout

    gpu_mem = parse_bytes(args.gpu_mem or "80GiB")
    print(f"plan: variants {args.variant_list}; {args.warmup} warm-up + {args.steps} rounds")
    for name, micro_batch in zip(args.config_list, args.micro_batches, strict=True):
        config = load(name, args.seq)
        resident, step = 0.0, 0.0
        for variant in args.variant_list:
            vconfig = variant_of(config, variant)
            params = total_parameters(vconfig)
            plan = plan_layout(vconfig, Layout(1, 1, 1, "ddp"), micro_batch, gpu_mem)
            worst = plan.worst.parts
            # the bench keeps every variant's bf16 weights and AdamW's bf16 moments (6 B),
            # and runs one step at a time: bf16 gradients (2 B) and activations
            resident += 6 * params
            step = max(step, 2 * params + worst["activations"] + worst["transient"])
            print(
                f"  {name} {variant}: {params:,} parameters, micro-batch {micro_batch} x seq "
                f"{args.seq}, {flops_per_token(vconfig) / 1e9:.2f} GFLOP/token; planner, "
                f"alone with mixed-precision Adam: {gib(plan.worst.total)} of {gib(gpu_mem)}"
            )
        print(f"  {name}, all variants resident as the bench runs them: {gib(resident + step)}")


def _reason(error: Exception, caught: list) -> str:
    """SDPA says why a kernel was refused in its warnings; the error only says none ran."""
    notes = [str(w.message).strip().splitlines()[0] for w in caught if "sdp" in str(w.message)]
    notes = notes or [str(error).strip().splitlines()[0]]
    return "; ".join(note[:120] for note in notes[:3])


def check_sdpa_backends() -> list[str]:
    """Which SDPA backend accepts which shape (bf16, causal, forward + backward)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lines, device = [], torch.device("cuda")
    shapes = {
        "MHA d=128": (16, 16, 128),
        "GQA 16q/8kv d=128": (16, 8, 128),
        "values 2d=256 (differential)": (8, 8, 256),
    }
    for label, (q_heads, kv_heads, v_dim) in shapes.items():
        results = []
        for backend in (
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
        ):
            q = torch.randn(2, q_heads, 1024, 128, device=device, dtype=torch.bfloat16)
            k = torch.randn(2, kv_heads, 1024, 128, device=device, dtype=torch.bfloat16)
            v = torch.randn(2, kv_heads, 1024, v_dim, device=device, dtype=torch.bfloat16)
            for tensor in (q, k, v):
                tensor.requires_grad_(True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(
                            q, k, v, is_causal=True, enable_gqa=q_heads != kv_heads
                        )
                        out.sum().backward()
                    torch.cuda.synchronize()
                    results.append(f"{backend.name}=ok")
                except RuntimeError as error:
                    results.append(f"{backend.name}=no ({_reason(error, caught)})")
        lines.append(f"  sdpa {label}: " + ", ".join(results))
    return lines


def check_variant_kernels(variants: list[str]) -> tuple[list[str], bool]:
    """One forward + backward of each variant's attention layer (head_dim 128, GQA)
    with SDPA restricted to flash + cuDNN: a variant that needs another kernel fails."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cqk_megatron.perf.bench import build_workload, load_bench_config

    config = load_bench_config(
        "tiny",
        [
            "model.hidden_size=2048",
            "model.num_attention_heads=16",
            "model.num_query_groups=8",
            "model.seq_length=1024",
            "train.precision=bf16",
        ],
    )
    lines, passed = [], True
    for variant in variants:
        work = build_workload(config, variant, 2, torch.device("cuda"), attention_only=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                    work.step()
                torch.cuda.synchronize()
                verdict = "ok"
            except RuntimeError as error:
                verdict = f"FAILED: {_reason(error, caught)}"
            if variant in REQUIRED_FLASH_VARIANTS:
                passed = False
            else:
                verdict += " (informational: this variant may use another kernel)"
        lines.append(f"  {variant} attention under flash/cuDNN only: {verdict}")
        del work
    torch.cuda.empty_cache()
    return lines, passed


def run_config(name: str, micro_batch: int, args: argparse.Namespace, device: torch.device) -> dict:
    from cqk_megatron.perf.bench import format_report, run_benchmark

    config = load(name, args.seq)
    result = run_benchmark(
        config,
        args.variant_list,
        rounds=args.steps,
        warmup=args.warmup,
        micro_batch=micro_batch,
        optimizer="adamw",
        device=device,
        log=lambda line: print(f"    {line}", flush=True),
    )
    result["meta"]["config"] = name
    print(format_report(result), flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def summarise(results: list[dict]) -> list[str]:
    lines = ["summary (coupled/standard step-time ratio target <= 1.05):"]
    for result in results:
        meta = result["meta"]
        for row in result["rows"]:
            mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            peak = "-" if row["step_peak_mib"] is None else f"{row['step_peak_mib'] / 1024:.1f}"
            lines.append(
                f"  {meta['config']:<28} {row['variant']:<22} {row['tokens_per_s']:>10.0f} tok/s"
                f"  MFU {mfu:>6}  step peak {peak:>5} GiB  ratio {row['ratio']:.3f}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    args = parse_args(argv)
    if args.dry_run:
        print_plan(args)
        return 0
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --dry-run / --allow-cpu")
        return 2
    start = time.monotonic()
    from cqk_megatron.perf.bench import init_world, load_bench_config, write_json
    from cqk_megatron.perf.flops import peak_flops

    device = init_world(load_bench_config("tiny"))
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {name}, dense bf16 "
        f"peak {peak_flops(name) or 'unknown'} FLOP/s"
    )
    passed = True
    if on_gpu:
        print("SDPA kernels:")
        print("\n".join(check_sdpa_backends()))
        lines, ok = check_variant_kernels(args.variant_list)
        print("\n".join(lines), flush=True)
        passed &= ok
    results = []
    for config_name, micro_batch in zip(args.config_list, args.micro_batches, strict=True):
        elapsed = time.monotonic() - start
        if elapsed > args.budget_s:
            print(
                f"skipping {config_name}: {elapsed:.0f} s used of the {args.budget_s:.0f} s budget"
            )
            passed = False
            continue
        print(f"\n{config_name}, micro-batch {micro_batch} x seq {args.seq} ({elapsed:.0f} s in)")
        try:
            results.append(run_config(config_name, micro_batch, args, device))
        except Exception:  # report and go on to the next config
            traceback.print_exc()
            passed = False
            if on_gpu:
                torch.cuda.empty_cache()
    print("\n" + "\n".join(summarise(results)))
    print(f"total {time.monotonic() - start:.0f} s; {'PASS' if passed else 'FAIL'}")
    if args.out:
        write_json({"passed": passed, "results": results}, args.out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
