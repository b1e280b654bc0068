"""The server's command line: engine options pass through to `LLM`, the HTTP ones go to uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from nanovllm.config import Config
from nanovllm.serve.app import create_app

# Engine options the command line does not offer: what only a program can pass.
HIDDEN_SETTINGS = ("load_format",)


def engine_options(parser: argparse.ArgumentParser) -> None:
    """One option per `Config` setting (``max_num_seqs`` -> ``--max-num-seqs``), typed as the field is."""
    group = parser.add_argument_group("engine", "passed to LLM(model, ...); defaults are the engine's")
    hints = typing.get_type_hints(Config)
    for f in fields(Config):
        if f.name not in Config.settings() or f.name in HIDDEN_SETTINGS:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        default = f.default if f.default is not MISSING else None
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(kind, types.UnionType):  # bool | str: True, False or "auto"
            group.add_argument(flag, choices=["auto", "on", "off"], default="auto")
        else:
            group.add_argument(flag, type=kind, default=default, metavar=f.name.upper())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.serve",
        description="An OpenAI-compatible server over nano-vllm's engine. Without --model, SmolLM2-135M-Instruct.")
    parser.add_argument("--model", help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the model's id in the API (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    parser.add_argument("--max-waiting", type=int, default=None, metavar="N",
                        help="refuse new requests (503) while N requests wait (default: no limit)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    engine_options(parser)
    return parser


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM` keyword arguments of the parsed command line."""
    switch = {"auto": "auto", "on": True, "off": False}
    settings = {}
    for name in Config.settings():
        if name in HIDDEN_SETTINGS:
            continue
        value = getattr(args, name)
        settings[name] = switch.get(value, value) if isinstance(value, str) and value in switch else value
    return settings


class Server(uvicorn.Server):
    """uvicorn's server, told about the application's streams: a signal first ends them (the driver stops, the
    live pages close), then uvicorn shuts down, and the process exits with status 0 rather than re-raising it.
    It prints the URL once it listens (``--port 0`` picks a free port: the line says which)."""

    def __init__(self, config: uvicorn.Config, name: str) -> None:
        super().__init__(config)
        self.name = name

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        shutdown = getattr(self.config.app.state, "shutdown", None)
        if shutdown is not None:
            shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # The signal asked for this shutdown, which is done: uvicorn would raise it again.
            self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"nano-vllm: serving {self.name} at http://{host}:{port} "
                  f"(the KV cache, live: http://{host}:{port}/dashboard)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from nanovllm.book.smollm2 import CacheNotWritableError, SmolLM2NotInstalledError, smollm2_dir

    try:
        model = args.model or str(smollm2_dir())
        name = args.served_model_name or Path(model).name
        from nanovllm.llm import LLM

        print(f"nano-vllm: loading {model}", file=sys.stderr, flush=True)
        engine = LLM(model, **engine_settings(args))
    except (TypeError, ValueError, SmolLM2NotInstalledError, CacheNotWritableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    try:
        app = create_app(engine, model_name=name, max_waiting=args.max_waiting)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=5, access_log=False)
        Server(config, name).run()
    finally:
        engine.exit()
    return 0
