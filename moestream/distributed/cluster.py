"""Reaching a Ray cluster: Ray imported only when asked for, an address checked before Ray is handed it (a
wrong one would otherwise retry for minutes), and a local instance started where the user says `local`."""

from __future__ import annotations

import os
import socket
from typing import Any

from moestream.errors import MoestreamError

# what `ray start --head` listens on when no --port is given
DEFAULT_PORT = 6379
# a local instance's object store: the expert tier's messages are one layer's rows, never large
LOCAL_OBJECT_STORE_MB = 200


def import_ray() -> Any:
    """The ray module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise MoestreamError(
            "Ray is not installed; install it with: pip install 'moestream[ray]' (or pip install 'ray[serve]')"
        ) from None
    return ray


def parse_address(address: str) -> tuple[str, int]:
    """HOST[:PORT] (ray://, a scheme Ray Client uses, is refused: the expert tier needs a cluster member)."""
    if not address or address.strip() != address or "://" in address:
        raise MoestreamError(
            f"--ray {address!r} is not a Ray address; give HOST:PORT of the head node (`ray start --head` prints it) "
            "or `local` to start Ray on this machine"
        )
    host, sep, port_text = address.rpartition(":")
    if not sep:
        host, port_text = address, str(DEFAULT_PORT)
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise MoestreamError(f"--ray {address!r}: the port must be a number from 1 to 65535 (HOST:PORT)")
    return host, int(port_text)


def check_reachable(host: str, port: int, timeout_s: float = 3.0) -> None:
    """A TCP connection to the head's GCS port, so that a wrong address fails in seconds with one line."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise MoestreamError(
            f"no Ray cluster answers at {host}:{port} ({exc.strerror or exc}); start one with "
            f"`ray start --head --port {port}` on that machine, or give its address"
        ) from None


def connect(address: str, num_cpus: int | None = None) -> Any:
    """Join the cluster at `address` (HOST:PORT) or start a local instance (`local`); returns ray. A driver
    already connected (serve-ray's replicas) is used as it is."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address == "local":
        kwargs.update(num_cpus=num_cpus or os.cpu_count() or 1, object_store_memory=LOCAL_OBJECT_STORE_MB << 20)
        ray.init(**kwargs)
        return ray
    host, port = parse_address(address)
    check_reachable(host, port)
    kwargs.pop("include_dashboard")
    try:
        ray.init(address=f"{host}:{port}", **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MoestreamError(f"could not join the Ray cluster at {host}:{port}: {first}") from None
    return ray
