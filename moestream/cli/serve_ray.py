"""`moestream serve-ray`: `serve`'s endpoint with N engine replicas behind it, on Ray Serve (docs/ray.md).

It takes `serve`'s options (the same parser) and: --replicas N, --address of a Ray cluster (without it, a
local Ray instance on 127.0.0.1 that ends with the command), --min-replicas/--max-replicas for Ray Serve's
autoscaling. --ram-budget-mb and --threads are per replica; Ray reserves them on the node it places a replica
on (its `memory` and `CPU` resources), so N replicas that the cluster's nodes cannot hold are refused before
anything starts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import threading
from typing import Any

from moestream.cli import values
from moestream.cli.options import engine_options
from moestream.cli.serve import API_KEY_ENV, add_serve_args, listen_socket
from moestream.engine.planning import DEFAULT_BATCH
from moestream.errors import MoestreamError
from moestream.serving.app import Defaults, default_model_name
from moestream.serving.worker import Admission
from moestream.streaming.budget import DEFAULT_KEEP_FREE_MB, MB, available_bytes

MAX_REPLICAS = 256
MOESTREAM_ERROR = re.compile(r"moestream\.errors\.\w+: (.+)")  # a replica's error, in Ray's traceback
STOP_S = 20.0  # the longest wait for the application's replicas to stop
LOCAL_OBJECT_STORE_MB = 200  # the replicas pass requests and answers through it, never weights


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    p.description = (
        "serve's OpenAI-compatible endpoint with N engine replicas behind it, on Ray Serve (docs/ray.md). It takes "
        "serve's options; --ram-budget-mb and --threads are each replica's, reserved on the node Ray places it on."
    )
    add_serve_args(p)
    p.add_argument("--replicas", type=values.whole(1, MAX_REPLICAS), default=1,
                   help="engine replicas behind the endpoint, each with its own --ram-budget-mb and --threads "
                   "(default 1)")  # fmt: skip
    p.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="the Ray cluster to run on (what `ray start --head` printed); default: a local Ray instance on "
        "127.0.0.1, ended when the command ends",
    )
    p.add_argument("--min-replicas", type=values.whole(0, MAX_REPLICAS), default=None,
                   help="autoscaling: Ray Serve keeps at least this many replicas (with --max-replicas)")  # fmt: skip
    p.add_argument("--max-replicas", type=values.whole(1, MAX_REPLICAS), default=None,
                   help="autoscaling: and at most this many, adding replicas as requests queue up; the budget "
                   "check counts this many")  # fmt: skip
    p.set_defaults(func=cmd_serve_ray)


def check_options(args: argparse.Namespace) -> None:
    """What serve-ray cannot do with serve's options, and autoscaling bounds that contradict each other."""
    if args.ray is not None or args.expert_workers is not None:
        raise MoestreamError("serve-ray does not take --ray/--expert-workers: give the cluster with --address")
    if args.trace is not None and max(args.replicas, args.max_replicas or 0) > 1:
        raise MoestreamError("--trace writes one file: it takes one replica (--replicas 1), not several")
    lo, hi = args.min_replicas, args.max_replicas
    if lo is not None and hi is not None and lo > hi:
        raise MoestreamError(f"--min-replicas {lo} is more than --max-replicas {hi}")
    if (lo is not None and args.replicas < lo) or (hi is not None and args.replicas > hi):
        raise MoestreamError(f"--replicas {args.replicas} is outside --min-replicas/--max-replicas ({lo}..{hi})")


def replica_spec(args: argparse.Namespace, threads: int, budget_mb: int) -> Any:
    """serve's options as each replica opens its engine and app with them."""
    from moestream.distributed.serve_app import ReplicaSpec

    args = argparse.Namespace(**{**vars(args), "threads": threads, "ram_budget_mb": budget_mb})
    engine = dataclasses.replace(engine_options(args), progress=False)  # a replica's log is no terminal
    defaults = Defaults(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                        max_tokens=args.max_tokens_default)  # fmt: skip
    return ReplicaSpec(
        model=os.path.abspath(args.model),
        engine=engine,
        name=args.model_name or default_model_name(args.model),
        defaults=defaults,
        admission=Admission(max_queue=args.max_queue, gather_s=args.batch_window_ms / 1000),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        webui=not args.no_webui,
        host=args.host,
    )


def fit(nodes: list[dict[str, float]], count: int, threads: int, budget_mb: int | None) -> tuple[int, int]:
    """(replicas the nodes hold, the budget in MiB): each replica takes `threads` CPUs and its budget of a
    node's memory resource. budget None: the largest budget with which `count` replicas fit."""

    def held(b: int) -> int:
        return sum(min(int(n.get("CPU", 0) // threads), int(n.get("memory", 0) // (b * MB))) for n in nodes)

    if budget_mb is not None:
        return held(budget_mb), budget_mb
    # the candidates: each node's memory shared by k replicas
    best = 0
    for n in nodes:
        for k in range(1, count + 1):
            b = int(n.get("memory", 0) // (k * MB))
            if b > best and held(b) >= count:
                best = b
    return (held(best) if best else 0), best


def settings_from_args(args: argparse.Namespace, ray: Any) -> Any:
    """The application's settings; the budget and threads checked against the cluster's nodes."""
    from moestream.distributed.serve_app import Settings

    check_options(args)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    most = max(args.replicas, args.max_replicas or 0)
    threads = args.threads or max(1, int(sum(n.get("CPU", 0) for n in nodes)) // most)
    held, budget = fit(nodes, most, threads, args.ram_budget_mb)
    if held < most:
        mem = ", ".join(f"{int(n.get('memory', 0) // MB)} MiB/{int(n.get('CPU', 0))} CPUs" for n in nodes)
        each = f"--ram-budget-mb {budget} and " if budget else ""
        where = "this machine" if args.address is None else "the Ray cluster's nodes"
        raise MoestreamError(
            f"{most} replicas with {each}--threads {threads} each do not fit {where} ({mem} free for them): they "
            f"hold {held}; lower --replicas, --ram-budget-mb or --threads, or add machines"
        )
    max_ongoing = (args.max_batch or DEFAULT_BATCH) + args.max_queue
    return Settings(replica_spec(args, threads, budget), args.replicas, args.min_replicas, args.max_replicas,
                    threads, budget * MB, max(1, max_ongoing))  # fmt: skip


def build(args: dict[str, str]) -> Any:
    """`serve run moestream.cli.serve_ray:build 'args=SERVE-RAY OPTIONS'`: the application builder."""
    from moestream.distributed.serve_app import build_app

    return build_app(settings_from_argv(args.get("args", "").split()))


def settings_from_argv(argv: list[str]) -> Any:
    """For `serve run ...:build`: the same options, parsed by the same parser, on the cluster serve run joined."""
    import ray

    from moestream.cli.main import build_parser, parse

    args = parse(build_parser("serve-ray"), ["serve-ray", *argv])
    args.address = args.address or os.environ.get("RAY_ADDRESS", "auto")  # a cluster, not this machine alone
    if not ray.is_initialized():  # serve run builds the application before it joins the cluster itself
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace="serve", log_to_driver=False)
    return settings_from_args(args, ray)


def start_ray(args: argparse.Namespace) -> Any:
    from moestream.distributed.cluster import check_reachable, import_ray, parse_address

    ray = import_ray()
    if args.address is None:
        listen_socket(args.host, args.port).close()  # a taken port fails now, not after the models load
        # what the replicas may reserve: the memory available now, less what `serve` keeps free
        memory = max(MB, available_bytes() - (DEFAULT_KEEP_FREE_MB + LOCAL_OBJECT_STORE_MB) * MB)
        ray.init(address="local", num_cpus=os.cpu_count() or 1, _memory=memory,
                 object_store_memory=LOCAL_OBJECT_STORE_MB * MB, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)  # fmt: skip
        return ray
    host, port = parse_address(args.address, "--address")
    check_reachable(host, port)
    try:
        ray.init(address=f"{host}:{port}", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise MoestreamError(f"could not join the Ray cluster at {host}:{port}: {first_line(exc)}") from None
    return ray


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def deploy_error(serve: Any, app_name: str, exc: BaseException) -> str:
    """Why a deployment failed: a replica's MoestreamError (a budget the model does not fit, say) from Serve's
    status of the application, else Ray's first line."""
    try:
        app = serve.status().applications[app_name]
        texts = [d.message for d in app.deployments.values()] + [app.message]
    except Exception:  # the status is gone with the cluster
        texts = []
    found = MOESTREAM_ERROR.search("\n".join([*texts, str(exc)]))
    return found.group(1).strip() if found else first_line(exc)


def running_serve_port(ray: Any) -> int | None:
    """The HTTP port of a Ray Serve already running on the cluster (another application's, or one an earlier
    command left), None where none runs: serve.start would keep that one's port and ignore --port."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None
    return int(ray.get(controller.get_http_config.remote()).port)


def cmd_serve_ray(args: argparse.Namespace) -> int:
    check_options(args)
    ray = start_ray(args)
    try:
        from ray import serve

        from moestream.distributed.serve_app import board_actor, build_app

        settings = settings_from_args(args, ray)
        running = running_serve_port(ray)
        if running is not None and running != args.port:
            raise MoestreamError(
                f"Ray Serve already runs on this cluster with its HTTP port {running}, and keeps it: give --port "
                f"{running}, or stop it first (`serve shutdown -y`)"
            )
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        print(f"moestream: starting {args.replicas} replicas ({settings.threads} threads and "
              f"{settings.memory_bytes // MB} MiB each)", flush=True)  # fmt: skip
        try:
            serve.run(build_app(settings), name=settings.app_name, route_prefix="/", blocking=False)
        except (RuntimeError, serve.exceptions.RayServeException) as exc:
            raise MoestreamError(f"the replicas did not start: {deploy_error(serve, settings.app_name, exc)}") from None
        print(f"moestream: serving on http://{args.host}:{args.port}/v1 with {args.replicas} replicas "
              f"(metrics of each and their sum at /metrics)", flush=True)  # fmt: skip
        wait_for_signal()
        if args.address is not None:  # the application leaves the cluster with the command, and Serve too
            # where this command started it (else the next one would find it holding this port)
            leave = serve.shutdown if running is None else lambda: serve.delete(settings.app_name)
            within(lambda: (ray.kill(board_actor(settings.board)), leave()), STOP_S)
    finally:
        ray.shutdown()  # the local instance ends with its replicas (a Ctrl-C reached them too); a driver of a
        # cluster disconnects
    return 0


def within(fn: Any, seconds: float) -> None:
    """Run fn, giving up after `seconds` (a cluster whose processes are already gone would block for good)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
