import os
import sys
import threading

from ..backend import BACKENDS, DEFAULT_BACKEND, DEFAULT_SLOTS, format_bytes
from ..models import resolve_model
from ._load import add_load_arguments
from ._rope import add_rope_arguments, rope_options

GRACEFUL_SHUTDOWN_SECONDS = 3

HELP = "serve a model over an OpenAI-compatible HTTP API (chat and text completions, streaming)"


def add_arguments(p):
    p.add_argument("model", metavar="MODEL", help="a GGUF path or a known model name (see `airframe pull`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--ctx", type=int, default=None, metavar="N", help="context length in tokens (default: the backend's)")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND, help=f"default {DEFAULT_BACKEND}")
    add_rope_arguments(p)
    add_load_arguments(p)
    p.add_argument("--api-key", default=os.environ.get("AIRFRAME_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $AIRFRAME_API_KEY)")
    p.add_argument("--no-prompt-cache", action="store_true",
                   help="prefill every request's whole prompt (default: keep the prefix it shares with the "
                        "request before, as llama-server's cache_prompt)")
    p.add_argument("--slots", type=int, default=None, metavar="N",
                   help="K/V caches allocated at load, each keeping one conversation's prompt warm; a request "
                        "goes to the slot sharing the longest prefix with it, else the least recently used. "
                        "Given N > 1, up to N requests generate at once, decoded in one batch per step "
                        f"(default {DEFAULT_SLOTS} where they fit in memory, one request at a time; "
                        "1 with --backend cuda)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait behind the running ones; more get 503 (default 64)")
    p.add_argument("--alias", action="extend", nargs="+", default=[], metavar="NAME",
                   help="more names the model answers to in /v1/models and `model`")
    p.add_argument("--strict-model", action="store_true",
                   help="answer 404 to a `model` that is neither the model's id nor an alias")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed to call the API besides localhost ('*' for any; repeatable)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name requests may use besides localhost and --host, when no --api-key is set "
                        "('*' for any; repeatable)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _watch_loading(state, server, outcome: dict) -> None:
    state.loaded.wait()
    if state.load_error:
        print(f"airframe: error: {state.load_error}", file=sys.stderr, flush=True)
        outcome["rc"] = 1
        server.should_exit = True
    else:
        backend = state.engine.backend
        kv = backend.kv_memory()
        memory = f", K/V cache {format_bytes(kv)}" if kv is not None else ""
        print(f"airframe: serving {state.model_id} (context {state.engine.n_ctx}, "
              f"{backend.n_slots} slot{'s' if backend.n_slots > 1 else ''}{memory})", flush=True)


def run(args) -> int:
    import uvicorn

    from ..backend import settle_slots
    from ..engine import Engine
    from ..errors import ParameterError
    from ..model import open_model
    from ..options import RunOptions
    from ..server import ServerOptions, create_app

    if args.max_queue < 0:
        raise ParameterError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.ctx is not None and args.ctx < 2:
        raise ParameterError(f"--ctx must be >= 2 tokens, got {args.ctx}")
    if args.slots is not None and args.slots < 1:
        raise ParameterError(f"--slots must be >= 1, got {args.slots}")
    resolve_model(args.model)  # a wrong name fails here, before the server starts
    run_options = RunOptions.from_env(n_ctx=args.ctx, progress=True, check_tensors=args.check_tensors,
                                      prompt_cache=not args.no_prompt_cache, slots=args.slots)
    opened = open_model(args.model, **rope_options(args))
    try:  # slots and context that do not fit in memory fail here, before the server starts
        run_options = settle_slots(args.backend, opened.config, run_options)
    except BaseException:
        opened.gguf.close()
        raise

    def load():
        return Engine.load(opened, backend=args.backend, options=run_options)

    options = ServerOptions(api_key=args.api_key, max_queue=args.max_queue,
                            batching=args.slots is not None and args.slots > 1,
                            aliases=tuple(args.alias), strict_model=args.strict_model,
                            cors_origins=tuple(args.cors_origin), bind_host=args.host,
                            allowed_hosts=tuple(args.allowed_host))
    app = create_app(load, options)
    # On Ctrl-C, open streams get a few seconds; then their tasks are cancelled, which cancels
    # their generations, instead of waiting for every answer to run to max_tokens.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    server = uvicorn.Server(config)
    outcome = {"rc": 0}
    threading.Thread(target=_watch_loading, args=(app.state.airframe, server, outcome), daemon=True).start()
    server.run()
    return outcome["rc"]
