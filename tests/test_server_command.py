"""`airframe serve`: its flags and how it ends when the model cannot be served."""

from __future__ import annotations

import pytest

from airframe.cli import build_parser, main
from airframe.engine import Engine
from airframe.errors import ParameterError
from airframe.models import resolve_model
from airframe.server import create_app


def test_defaults_bind_to_loopback():
    args = build_parser().parse_args(["serve", "smollm2-135m"])
    assert (args.host, args.port, args.backend, args.max_queue) == ("127.0.0.1", 8080, "webgpu", 64)
    assert (args.ctx, args.alias, args.strict_model) == (None, [], False)


def test_every_flag_parses():
    args = build_parser().parse_args([
        "serve", "m.gguf", "--host", "0.0.0.0", "--port", "9000", "--ctx", "1024", "--backend", "reference",
        "--api-key", "k", "--max-queue", "3", "--alias", "a", "b", "--alias", "c", "--strict-model", "--slots", "3"])
    assert (args.host, args.port, args.ctx, args.backend, args.api_key) == ("0.0.0.0", 9000, 1024, "reference", "k")
    assert (args.max_queue, args.alias, args.strict_model, args.slots) == (3, ["a", "b", "c"], True, 3)


def test_an_unknown_model_fails_before_the_server_starts(capsys):
    assert main(["serve", "no-such-model.gguf", "--port", "0"]) == 1
    assert "no-such-model.gguf" in capsys.readouterr().err


def test_bad_flags_are_refused_with_the_allowed_range(capsys):
    assert main(["serve", "smollm2-135m", "--max-queue", "-1"]) == 1
    assert "--max-queue must be >= 0, got -1" in capsys.readouterr().err


def test_slots_below_one_or_beyond_memory_are_refused_before_the_server_starts(monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "load", never)
    assert main(["serve", "smollm2-135m", "--slots", "0"]) == 1
    assert "airframe: error: --slots must be >= 1, got 0\n" in capsys.readouterr().err
    assert main(["serve", "smollm2-135m", "--slots", "100000", "--backend", "reference", "--ctx", "4096"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("airframe: error: 100000 slots of 4,096 positions need ") and err.count("\n") == 1
    assert "of memory are available; expected at most " in err and " slots of 4,096 positions" in err


def test_a_model_that_fails_to_load_stops_the_server_with_status_1(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise ParameterError("n_ctx = 1, expected an integer >= 2")

    monkeypatch.setattr(Engine, "load", refuse)
    path = str(resolve_model("smollm2-135m"))
    assert main(["serve", path, "--port", "0", "--log-level", "critical"]) == 1
    assert "loading the model failed: n_ctx = 1, expected an integer >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--backend", "--port"])
def test_bad_choices_are_argparse_errors(flag):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", flag, "nonsense"])


def test_serve_checks_the_host_header_against_its_address_and_allowed_hosts(monkeypatch):
    import uvicorn

    import airframe.server
    from airframe.server.app import allowed_hosts

    made = []
    monkeypatch.setattr(airframe.server, "create_app", lambda load, options: made.append(options) or create_app(load, options))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    monkeypatch.setattr(Engine, "load", lambda *a, **k: (_ for _ in ()).throw(ParameterError("not loaded here")))
    # (the server itself does not run: only the options it was given are looked at)
    main(["serve", "smollm2-135m", "--host", "127.0.0.2", "--allowed-host", "box.lan", "--allowed-host", "Pi.local"])
    assert allowed_hosts(made[0]) == {"localhost", "127.0.0.1", "::1", "127.0.0.2", "box.lan", "pi.local"}
    main(["serve", "smollm2-135m", "--api-key", "k"])
    assert allowed_hosts(made[1]) is None  # the key guards every model route


def test_the_startup_line_says_the_slots_and_their_k_v_memory(tmp_path, capsys):
    import threading
    from types import SimpleNamespace

    from airframe.backend import format_bytes, kv_cache_bytes
    from airframe.commands.serve import _watch_loading
    from airframe.options import RunOptions
    from airframe.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", "tiny", "Q8_0")
    engine = Engine.load(path, backend="reference", options=RunOptions(n_ctx=64, slots=3))
    state = SimpleNamespace(loaded=threading.Event(), load_error=None, model_id="tiny", engine=engine)
    state.loaded.set()
    _watch_loading(state, None, {})
    kv = format_bytes(kv_cache_bytes(engine.config, 64, 3))
    assert capsys.readouterr().out == f"airframe: serving tiny (context 64, 3 slots, K/V cache {kv})\n"
