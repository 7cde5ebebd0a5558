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


def parse_address(address: str, option: str = "--ray") -> tuple[str, int]:
    """HOST[:PORT] (ray://, a scheme Ray Client uses, is refused: the expert tier and serve-ray need a cluster
    member); `option` names the option that gave it."""
    if not address or address.strip() != address or "://" in address:
        raise MoestreamError(
            f"{option} {address!r} is not a Ray address; give HOST:PORT of the head node (`ray start --head` prints "
            "it) or `local` to start Ray on this machine"
        )
    host, sep, port_text = address.rpartition(":")
    if not sep:
        host, port_text = address, str(DEFAULT_PORT)
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise MoestreamError(f"{option} {address!r}: the port must be a number from 1 to 65535 (HOST:PORT)")
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
    already connected (a second engine in one process) keeps its connection where it is the cluster asked for."""
    ray = import_ray()
    host, port = parse_address(address) if address != "local" else ("", 0)
    if address != "local":
        check_reachable(host, port)
    if ray.is_initialized():
        if address != "local":
            check_same_cluster(ray, host, port)
        return ray
    kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    if address == "local":
        # address="local": a new instance even where this machine already runs a cluster (ray.init would join it)
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1,
                 object_store_memory=LOCAL_OBJECT_STORE_MB << 20, include_dashboard=False, **kwargs)  # fmt: skip
        return ray
    try:
        ray.init(address=f"{host}:{port}", **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MoestreamError(f"could not join the Ray cluster at {host}:{port}: {first}") from None
    return ray


def check_same_cluster(ray: Any, host: str, port: int) -> None:
    """This process's Ray connection is to HOST:PORT, or one line says which one it holds."""
    current = ray.get_runtime_context().gcs_address
    c_host, _, c_port = current.rpartition(":")
    try:
        same = int(c_port) == port and socket.gethostbyname(host) == socket.gethostbyname(c_host)
    except (OSError, ValueError):
        same = False
    if not same:
        raise MoestreamError(
            f"this process is already connected to the Ray cluster at {current}; --ray {host}:{port} names another"
        )
