"""Who may use a local Spark Connect server, and which server a client trusts (#51).

A Spark Connect server runs whatever its clients send as its own user, and a session's settings
hold the lake's secrets (runtime.session.configure_session). The local stack's server
(devstack.localstack.LocalSparkConnect) listens on loopback, where every user of the machine can
reach it. So:

- The server requires a pre-shared token (Spark 4's `spark.connect.authenticate.token`). It gets
  it in its environment (SPARK_CONNECT_AUTHENTICATE_TOKEN), which only its own user can read
  (/proc/<pid>/environ), never on its command line; a new token at each start, kept in a 0600
  file of its 0700 folder. A client reads that file (CDC_SPARK_CONNECT_TOKEN_FILE names it) and
  sends the token with every request; without it no request runs, and no session can be attached
  to (a session id, which the UI's pages show, is not enough).
- Before a client sends the token or any secret to a loopback address, it checks who listens
  there: the socket's owner (the kernel's /proc/net/tcp) must be the expected user, its own or
  CDC_SPARK_CONNECT_OWNER's. After a reboot another user can bind the port first; the client
  then stops with an error instead of handing that user the token and the lake's secrets.

A remote server (another host) is authenticated by TLS and its own token (`use_ssl`, the Airflow
connection's password): none of this applies to it.

Pure standard library, no pyspark import.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import secrets
import stat
from pathlib import Path

TOKEN_FILE_ENV = "CDC_SPARK_CONNECT_TOKEN_FILE"
OWNER_ENV = "CDC_SPARK_CONNECT_OWNER"
# Read by the server at its start (Connect.CONNECT_AUTHENTICATE_TOKEN_ENV, spark-connect 4.1).
SERVER_TOKEN_ENV = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
DEFAULT_PORT = 15002  # Spark Connect's, when a URL names none
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


class ServerIdentityError(RuntimeError):
    """A loopback Spark Connect address served by a process of another user."""


class TokenFileError(ValueError):
    """A token file that is missing, or that other users could read or replace."""


def new_token(path: Path) -> str:
    """A fresh token in `path`, written 0600 before it has any content."""
    token = secrets.token_urlsafe(32)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def read_token(path: Path) -> str:
    """The token in `path`, if only this user can read or replace the file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise TokenFileError(
            f"{TOKEN_FILE_ENV}={path}: no such file. The local Spark Connect server writes it when it starts "
            "(make pg-start); point the variable at its folder's `token`"
        ) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise TokenFileError(
            f"{TOKEN_FILE_ENV}={path}: must be a regular file of this user (uid {os.geteuid()}) that no other user "
            f"can read or write (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}); chmod 600 it, or restart "
            "the server to write a new one"
        )
    return path.read_text().strip()


def expected_owner() -> int:
    """The uid a local server must run as: CDC_SPARK_CONNECT_OWNER (a user name or uid), else ours."""
    named = os.environ.get(OWNER_ENV, "").strip()
    if not named:
        return os.geteuid()
    return int(named) if named.isdigit() else pwd.getpwnam(named).pw_uid


def listener_owners(port: int, proc_net: Path = Path("/proc/net")) -> set[int]:
    """The uids of the sockets listening on `port` on an address loopback reaches (the kernel's
    view, /proc/net/tcp and tcp6); empty where there is none or no /proc."""
    owners = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 8 or f[3] != _LISTEN:
                continue
            addr, _, hexport = f[1].partition(":")
            if int(hexport, 16) == port and _reaches_loopback(addr):
                owners.add(int(f[7]))
    return owners


def _reaches_loopback(hexaddr: str) -> bool:
    """/proc/net/tcp{,6} addresses are the kernel's words in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def check_listener(host: str, port: int) -> None:
    """Refuse a loopback address that a process of another user listens on."""
    if not _is_loopback(host):
        return
    owners, want = listener_owners(port), expected_owner()
    if owners - {want}:
        raise ServerIdentityError(
            f"the Spark Connect address {host}:{port} is served by a process of uid {sorted(owners - {want})}, not of "
            f"uid {want}: another local user may have taken the port while the server was down. Nothing was sent "
            f"to it. Stop that process or move the server (CDC_LOCAL_SPARK_PORT); if the server runs as another "
            f"user on purpose, name it in {OWNER_ENV}"
        )


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_url(url: str) -> str:
    """`url` (sc://host:port[/;params]) as a client sends to it: on loopback, the listener checked and
    the token of CDC_SPARK_CONNECT_TOKEN_FILE added when the URL has none. With a
    token and no TLS, pyspark speaks to `localhost` only (gRPC local credentials; any other name
    gets TLS), so a loopback address is named that way."""
    netloc, _, tail = url.removeprefix("sc://").partition("/")
    params = [p for p in tail.split(";") if p]
    host, port = netloc, ""
    if netloc.count(":") == 1 or netloc.startswith("["):  # host:port, [v6]:port
        host, _, port = netloc.rpartition(":")
    check_listener(host, int(port or DEFAULT_PORT))
    keys = {p.split("=", 1)[0] for p in params}
    token_file = os.environ.get(TOKEN_FILE_ENV)
    if "token" not in keys and token_file and _is_loopback(host):  # the local server's: never sent elsewhere
        params.append(f"token={read_token(Path(token_file))}")
        keys.add("token")
    if "token" in keys and "use_ssl=true" not in [p.lower() for p in params] and _is_loopback(host):
        netloc = f"localhost:{port}" if port else "localhost"
    return f"sc://{netloc}/;{';'.join(params)}" if params else f"sc://{netloc}"
