"""`moestream serve | chat`: the OpenAI-compatible HTTP server and the terminal chat."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from moestream.cli import values
from moestream.cli.options import add_engine_args, add_prompt_cache_arg, add_sampling_args, open_engine, sampler
from moestream.engine.planning import DEFAULT_BATCH
from moestream.errors import MoestreamError
from moestream.serving.app import DEFAULT_MAX_TOKENS, Defaults, default_model_name, serve
from moestream.serving.chat import HELP, ChatSession, repl
from moestream.serving.worker import DEFAULT_GATHER_MS, DEFAULT_MAX_QUEUE, Admission

API_KEY_ENV = "MOESTREAM_API_KEY"


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening, made before the model loads: a taken port fails in a
    second instead of after the load, and uvicorn serves on this very socket, so no one takes it between."""
    where = f"{host}:{port}"
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except socket.gaierror:
        raise MoestreamError(f"cannot listen on {where}: unknown host {host!r}; pass an address in --host") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = f"port {port} is already in use; stop what listens there or pass another --port"
        elif exc.errno == errno.EACCES:
            why = f"permission denied for port {port}; ports below 1024 need root, pass --port 1024 or higher"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = f"{host} is not an address of this machine; pass one in --host (127.0.0.1, 0.0.0.0)"
        else:
            why = exc.strerror or str(exc)
        raise MoestreamError(f"cannot listen on {where}: {why}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    sock = listen_socket(args.host, args.port)
    try:
        engine = open_engine(args)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]  # --port 0: the port the system chose
    try:
        name = args.model_name or default_model_name(args.model)
        defaults = Defaults(
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens_default,
        )
        if engine.plan is not None:
            print(engine.plan.describe(), flush=True)
        print(
            f"moestream: serving {name} on http://{args.host}:{port}/v1 (context {engine.ctx} tokens, "
            f"{engine.max_batch} requests at once, {engine.snapshot().n_slots} expert slots)",
            flush=True,
        )
        if not args.no_webui:
            print(f"moestream: chat page at http://{args.host}:{port}/, engine view at /engine", flush=True)
        stopped_by = serve(
            engine,
            name,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            defaults=defaults,
            admission=Admission(max_queue=args.max_queue, gather_s=args.batch_window_ms / 1000),
            sock=sock,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            webui=not args.no_webui,
        )
    finally:
        engine.close()
        sock.close()
    if stopped_by is not None:
        raise MoestreamError(stopped_by)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    pick = sampler(args)
    engine = open_engine(args)
    try:
        kwargs = {"enable_thinking": False} if args.no_think else {}
        session = ChatSession(
            engine, pick, system=args.system, max_tokens=args.n, template_kwargs=kwargs, dim=sys.stdout.isatty()
        )
        print(
            f"moestream chat: {args.model} (context {engine.ctx} tokens, {engine.snapshot().n_slots} expert "
            f"slots)\n{HELP}",
            flush=True,
        )
        repl(session, tty=sys.stdin.fileno() if sys.stdin.isatty() else None)
    finally:
        engine.close()
    return 0


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    {"serve": add_serve_args, "chat": _chat_args}[command](p)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_prompt_cache_arg(p)
    # defaults for requests that leave them out; 1.0 is OpenAI's default temperature
    p.add_argument("--temp", type=values.temperature, default=1.0, help="default temperature (default 1.0)")
    p.add_argument("--top-k", type=values.top_k, default=0, help="default top-k (default 0 = off)")
    p.add_argument("--top-p", type=values.top_p, default=1.0, help="default top-p (default 1.0)")
    p.add_argument("--seed", type=values.seed, default=None, help="default seed (default: random)")
    p.add_argument(
        "--max-tokens-default",
        type=values.positive,
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens a request that gives no max_tokens may generate (default {DEFAULT_MAX_TOKENS}; never more "
        "than fits the context). A request's own max_tokens may be up to the context length; one above it is "
        "refused with 400, and one that fits the context but not after its prompt is cut to what fits "
        "(finish_reason 'length')",
    )
    p.add_argument(
        "--max-batch",
        type=values.whole(1, 64),
        default=None,
        help=f"requests that generate together, each with its own KV cache at --ctx, counted in the budget "
        f"(default: up to {DEFAULT_BATCH} where their KV caches take at most a quarter of the expert cache's "
        "room); each layer's experts are read once for all of them",
    )
    p.add_argument(
        "--max-queue",
        type=values.whole(0, 1 << 20),
        default=DEFAULT_MAX_QUEUE,
        help=f"requests that may wait for a free slot; beyond them the server answers 429 with Retry-After "
        f"(default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--batch-window-ms",
        type=values.whole(0, 10_000),
        default=DEFAULT_GATHER_MS,
        help="requests that arrive within 100 ms of each other start together, each layer's experts read once "
        f"for all their prompts; the wait for the rest of such a burst lasts at most this long (default "
        f"{DEFAULT_GATHER_MS}; 0 starts every request at once)",
    )
    p.add_argument("--host", type=values.text, default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=values.port, default=8080, help="port (default 8080)")
    p.add_argument(
        "--api-key",
        type=values.text,
        default=None,
        help=f"every /v1 request must send 'Authorization: Bearer KEY' (else 401); default: ${API_KEY_ENV}, which "
        "keeps the key out of the process list",
    )
    p.add_argument(
        "--no-webui",
        action="store_true",
        help="no chat page at / nor engine view at /engine (/v1/engine/events, its feed, stays for scripts)",
    )
    p.add_argument("--model-name", type=values.text, default=None, help="model id clients use (default: the file name)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the HTTP server's log level (default info)",
    )
    p.set_defaults(func=cmd_serve)


def _chat_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_prompt_cache_arg(p)
    add_sampling_args(p)
    p.add_argument(
        "-n",
        type=values.positive,
        default=DEFAULT_MAX_TOKENS,
        help=f"most tokens per answer (default {DEFAULT_MAX_TOKENS}, as serve's requests; never more than fits "
        "the context): a model that never stops is cut there",
    )
    p.add_argument("--system", type=values.text, default=None, help="system message")
    p.add_argument("--no-think", action="store_true", help="ask Qwen3-style models not to think first")
    p.set_defaults(func=cmd_chat)
