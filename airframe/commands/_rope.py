"""The `--rope-scaling` / `--rope-scale` flags shared by every command that opens a model."""

ROPE_SCALING_TYPES = ("none", "linear", "yarn", "llama3")


def add_rope_arguments(p) -> None:
    p.add_argument("--rope-scaling", choices=ROPE_SCALING_TYPES, default=None,
                   help="RoPE scaling to use instead of the one the file declares (docs/EXTENDED_CONTEXT.md)")
    p.add_argument("--rope-scale", type=float, default=None, metavar="S",
                   help="context extension factor S >= 1 for --rope-scaling")


def rope_options(args) -> dict:
    """The open_model keyword arguments the flags ask for (None when they are absent)."""
    return {"rope_scaling": args.rope_scaling, "rope_scale": args.rope_scale}
