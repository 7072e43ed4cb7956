import json

from ..errors import ParameterError
from ..models import resolve_model
from ._load import add_load_arguments

HELP = "measure prefill and decode speed of a model (tokens/s, ms/token, share of the bandwidth floor)"
DEFAULT_PREFILL = 512


def add_arguments(p):
    p.add_argument("model", metavar="MODEL", help="model name or GGUF path")
    p.add_argument("--backend", default="webgpu", choices=["webgpu", "cuda"], help="backend to measure")
    p.add_argument("--ctx-list", default="1,512,4096", help="decode contexts, comma-separated (default 1,512,4096); "
                   "the largest is also the depth of the second prefill")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per context (median)")
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help=f"prompt tokens of the prefill measurements (webgpu; default {DEFAULT_PREFILL})")
    p.add_argument("--concurrency", default=None, metavar="LIST",
                   help="instead, decode of N conversations at once for each N, comma-separated (e.g. 1,4,8): "
                        "aggregate tokens/s and each stream's ms/token (webgpu)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    add_load_arguments(p)


def _contexts(text: str, option: str = "--ctx-list") -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ParameterError(f"{option} = {text!r}, expected comma-separated positive integers") from None
    if not values or min(values) < 1:
        raise ParameterError(f"{option} = {text!r}, expected comma-separated positive integers")
    return values


def run(args) -> int:
    if args.steps < 1:
        raise ParameterError(f"--steps = {args.steps}, expected an integer >= 1")
    if args.prefill is not None and args.prefill < 1:
        raise ParameterError(f"--prefill = {args.prefill}, expected an integer >= 1")
    contexts = _contexts(args.ctx_list)
    levels = _contexts(args.concurrency, "--concurrency") if args.concurrency is not None else None
    if levels is not None and args.backend != "webgpu":
        raise ParameterError(f"--concurrency with --backend {args.backend}, expected --backend webgpu: the "
                             f"CUDA megakernel decodes one conversation")
    path = resolve_model(args.model)
    if args.check_tensors:
        from ..gguf_file import GGUFFile
        from ..tensor_check import check_tensors

        with GGUFFile(path) as gf:
            check_tensors(gf, progress=True)
    if args.backend == "cuda":
        if args.prefill is not None:
            raise ParameterError(f"--prefill = {args.prefill} with --backend cuda, expected no --prefill: "
                                 f"the CUDA bench times decode launches only")
        from ..megakernel.cuda.bench import run as bench_cuda

        return bench_cuda(path, contexts)
    if levels is not None:
        from ..gpu.bench import bench_concurrency, format_concurrency

        result = bench_concurrency(path, levels, steps=args.steps, progress=True)
        print(json.dumps(result, indent=2) if args.json else format_concurrency(result))
        return 0
    from ..gpu.bench import bench_webgpu, format_result

    result = bench_webgpu(path, contexts, steps=args.steps, prefill_tokens=args.prefill or DEFAULT_PREFILL)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0
