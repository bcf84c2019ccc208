"""Where an announced version lies, for each transport: the one path helper of the file transport and the URI of
the dist transport, and the checks both the buffer and the producers apply to an announcement's uri. No torch
here: the buffer imports this.

    file:  /run/weights/v000012.safetensors (or file://...), directly in the run's weights directory
    dist:  dist://HOST:PORT/v000012, HOST:PORT = the learner rank 0's rendezvous store (weights.dist_host)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FILE_NAME = re.compile(r"^v(\d{6,})\.safetensors$")
DIST_SCHEME = "dist://"
_DIST = re.compile(r"^dist://(?P<host>[^/:\s\[\]]+|\[[0-9a-fA-F:.]+\]):(?P<port>\d{1,5})/v(?P<version>\d{6,})$")


def weights_path(weights_dir: str | Path, version: int) -> Path:
    """The file of `version` in `weights_dir`."""
    return Path(weights_dir) / f"v{version:06d}.safetensors"


def local_path(uri: str) -> str:
    """The local path of a file announcement's uri (a path or file://)."""
    return uri[len("file://"):] if uri.startswith("file://") else uri


def file_uri_problem(uri: str, weights_dir: str | Path, version: int | None = None) -> str:
    """Why `uri` is not a weights file directly in `weights_dir` ("" if it is), symlinks resolved; with `version`,
    also why it is not that version's file."""
    path = local_path(uri)
    if "://" in path or not path.startswith("/"):
        return (f"weights uri {uri[:200]!r} is not an absolute path or file:// URI (the file transport loads local "
                "safetensors files; across machines without a shared filesystem use weights.transport = \"dist\")")
    root, real = os.path.realpath(weights_dir), os.path.realpath(path)
    if os.path.dirname(real) != root or not FILE_NAME.match(os.path.basename(real)):
        return f"weights uri {uri[:200]!r} is not a weights file directly in the run's weights directory {root}"
    if version is not None and os.path.basename(real) != weights_path("", version).name:
        return f"weights uri {uri[:200]!r} is not the file of version {version}"
    return ""


def dist_uri(host: str, port: int, version: int) -> str:
    return f"{DIST_SCHEME}{host}:{port}/v{version:06d}"


def parse_dist_uri(uri: str) -> tuple[str, int, int]:
    """(host, port, version) of a dist announcement's uri; ValueError if it is not one."""
    m = _DIST.match(uri)
    if not m or not 0 < int(m.group("port")) < 65536:
        raise ValueError(f"weights uri {uri[:200]!r} is not dist://HOST:PORT/vNNNNNN")
    return m.group("host"), int(m.group("port")), int(m.group("version"))


def dist_uri_problem(uri: str, dist_host: str, dist_port: int, version: int | None = None) -> str:
    """Why `uri` is not a dist announcement of this run's learner ("" if it is): it must name weights.dist_host
    (and weights.dist_port when that is set), so no announcement can send a producer to another machine."""
    try:
        host, port, v = parse_dist_uri(uri)
    except ValueError as exc:
        return f"{exc} (weights.transport is \"dist\")"
    if host != dist_host:
        return f"weights uri {uri[:200]!r} names host {host!r}, not weights.dist_host {dist_host!r}"
    if dist_port and port != dist_port:
        return f"weights uri {uri[:200]!r} names port {port}, not weights.dist_port {dist_port}"
    if version is not None and v != version:
        return f"weights uri {uri[:200]!r} is not of version {version}"
    return ""
