"""The loading flags shared by every command that loads a model's weights (run, chat, serve,
perplexity, bench)."""


def add_load_arguments(p) -> None:
    p.add_argument("--check-tensors", action="store_true",
                   help="scan every weight for NaN and infinity before loading (reads the whole file once)")
