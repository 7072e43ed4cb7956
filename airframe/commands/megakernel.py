"""`airframe megakernel plan|show|stats`: plan a model for the CUDA megakernel and look at plans."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import ParameterError

HELP = "plan a model for the CUDA megakernel (plan), draw a package (show), print plan statistics (stats)"


def _target_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help="GGUF path or known model name")
    p.add_argument("--target", required=True, metavar="NAME|FILE.json",
                   help="rtx3050, h200, or a target description written by the probe")
    p.add_argument("--workers", type=int, help="override the target's worker count")
    p.add_argument("--ctx", type=int, help="K/V cache positions the plan is made for (default: min(train, 4096))")
    p.add_argument("--attn-chunk", type=int, help="most positions per attention chunk (default: ctx / (workers // kv_heads))")
    p.add_argument("--attn-spread", type=int, metavar="N",
                   help="spread a shorter context over up to N attention chunks (default 4; 0: fixed chunks)")
    p.add_argument("--attn-wide", type=int, metavar="N",
                   help="spread a longer context over up to N attention chunks of at least 128 positions "
                        "(default 16; 0: none)")
    p.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                   help="cut weight waves finer than whole rows where whole rows are more than 1%% uneven: "
                        "split-K pieces for QKV/WO, shared leftover FFN rows (default: what the worker runs)")


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    plan = sub.add_parser("plan", help="write a package: plan + weights (Q8_0 where every matrix of the model is, else BF16) + target")
    _target_arguments(plan)
    plan.add_argument("-o", "--output", required=True, metavar="DIR", help="package folder")
    plan.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    stats = sub.add_parser("stats", help="tasks, waves, bytes per worker per wave, imbalance")
    _target_arguments(stats)
    stats.add_argument("--json", action="store_true", help="print the statistics as JSON")
    show = sub.add_parser("show", help="draw bytes per worker per wave, and a traced token's timeline")
    show.add_argument("package", metavar="PKG", help="package folder")
    show.add_argument("--trace", metavar="TRACE.json", help="per-task start/end times of a traced run")
    show.add_argument("--layer", type=int, default=0, help="layer to draw (default 0)")
    show.add_argument("-o", "--output", required=True, metavar="DIR", help="folder for the PNG files")


def _check_positive(args) -> None:
    for name in ("workers", "ctx", "attn_chunk"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise ParameterError(f"--{name.replace('_', '-')} {value}, expected a positive integer")
    for name, none in (("attn_spread", "fixed chunks"), ("attn_wide", "none")):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise ParameterError(f"--{name.replace('_', '-')} {value}, expected 0 ({none}) or more")


def _split(args) -> bool:
    from ..megakernel.plan.planner import SPLIT_DEFAULT

    return SPLIT_DEFAULT if args.split is None else args.split


def run(args) -> int:
    return {"plan": _plan, "stats": _stats, "show": _show}[args.action](args)


def _plan(args) -> int:
    from ..models import resolve_model
    from ..megakernel.plan.package import write_package
    from ..megakernel.plan.planner import plan_stats
    from ..megakernel.plan.target import load_target

    _check_positive(args)
    target = load_target(args.target, args.workers)
    package = write_package(resolve_model(args.model), target, args.output, args.ctx, args.attn_chunk,
                            progress=not args.quiet, split=_split(args), attn_spread=args.attn_spread,
                            attn_wide=args.attn_wide)
    stats = plan_stats(package.plan)
    print(f"{package.path}: {stats['tasks']} tasks in {stats['waves']} waves on {target.workers} workers, "
          f"{stats['bytes_per_token'] / 1e9:.3f} GB per token at full context, "
          f"weight-wave imbalance {100 * stats['max_weight_wave_imbalance']:.2f}%")
    return 0


def _stats(args) -> int:
    from ..family import load_config
    from ..gguf_file import GGUFFile
    from ..models import resolve_model
    from ..megakernel.plan.package import weight_format
    from ..megakernel.plan.planner import make_plan, plan_stats
    from ..megakernel.plan.target import load_target

    _check_positive(args)
    target = load_target(args.target, args.workers)
    gf = GGUFFile(resolve_model(args.model))
    config = load_config(gf)
    plan = make_plan(config, target, args.ctx, args.attn_chunk, split=_split(args), attn_spread=args.attn_spread,
                     attn_wide=args.attn_wide, weights=weight_format(gf, config))
    stats = plan_stats(plan)
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    print(format_stats(plan, stats))
    return 0


def format_stats(plan, stats: dict) -> str:
    from ..megakernel.plan.planner import plan_is_split

    k = plan.consts
    spread = f"a shorter context spread over up to {k['attn_spread']}" if k["attn_spread"] else "fixed"
    if k["attn_spread"] and k["attn_wide"]:
        spread += f", a longer one over up to {k['attn_wide']} of {k['attn_wide_min']}+ positions"
    lines = [f"target {plan.target.name} ({plan.target.arch}): {stats['workers']} workers, "
             f"ctx {k['ctx']}, attention chunk {k['attn_chunk']} positions x {k['attn_chunks']} ({spread}), "
             f"{'split-K pieces and shared FFN rows' if plan_is_split(plan) else 'whole rows'}, "
             f"{'Q8_0' if k['weights_q8'] else 'BF16'} matrices",
             f"tasks {stats['tasks']}, waves {stats['waves']}, "
             f"bytes per token {stats['bytes_per_token']:,} (weights + K/V at full context)",
             f"largest imbalance in a weight wave: {100 * stats['max_weight_wave_imbalance']:.2f}%",
             "", f"{'wave':<14}{'opcode':<12}{'tasks':>6}{'busy':>6}{'max B/worker':>14}"
             f"{'mean B/worker':>15}{'imbalance':>11}"]
    shown = [w for w in stats["per_wave"] if w["layer"] == 0 or not w["name"].startswith("L")]
    for w in shown:
        lines.append(f"{w['name']:<14}{w['opcode']:<12}{w['tasks']:>6}{w['busy_workers']:>6}"
                     f"{w['max_bytes']:>14,}{w['mean_bytes']:>15,.0f}{100 * w['imbalance']:>10.2f}%")
    lines.append(f"(layers 1..{k['n_layers'] - 1} repeat layer 0)")
    return "\n".join(lines)


def _show(args) -> int:
    from ..megakernel.plan.package import Package
    from ..megakernel.plan.pictures import draw_package

    package = Package.load(args.package)
    for path in draw_package(package.plan, Path(args.output), args.trace, args.layer):
        print(path)
    return 0
