"""The local Spark Connect server as another user of the machine meets it (#51).

The suite's server is started as the local stack starts its own (devstack.localstack
.LocalSparkConnect). Another local user (`nobody`: a process of this suite that drops to its uid
after loading its modules, so that the checkout need not be readable by it) tries what the review
did: run code on the server, attach to a test's session by its id and read its settings, read the
server's token, its settings file and its environment. And a listener of another user on the
port, where a server of ours is expected, gets neither the token nor a request."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import threading
import time

import pytest
from cdc_lakehouse.runtime.connect_auth import ServerIdentityError
from cdc_lakehouse.runtime.session import connect_session

from tests.conftest import ROOT

# Runs as root, loads what it needs (a full session with the token, so that pyspark's lazy
# imports are done), then becomes `nobody` and tries each way in without the token.
_AS_NOBODY = r"""
import json, os, sys
a = json.loads(sys.argv[1])
from pyspark.sql import SparkSession
from cdc_lakehouse.runtime.session import connect_session
warm = connect_session(a["url"])
assert warm.range(3).count() == 3
warm.stop()
os.environ.pop("CDC_SPARK_CONNECT_TOKEN_FILE")
os.setgroups([])
os.setgid(a["gid"])
os.setuid(a["uid"])
out = {}

def attempt(name, url, fn):
    try:
        s = SparkSession.builder.remote(url).create()
        out[name] = "ran: " + repr(fn(s))
    except Exception as e:
        out[name] = "refused: " + f"{type(e).__name__}: {e}"[:400]

port = a["port"]
attempt("code", f"sc://localhost:{port}", lambda s: s.range(5).count())
attempt("guessed token", f"sc://localhost:{port}/;token=guess", lambda s: s.range(5).count())
attempt("attach", f"sc://localhost:{port}/;session_id={a['session']};user_id={a['user']}",
        lambda s: s.conf.get(a["setting"]))
for name, path in a["files"].items():
    try:
        with open(path, "rb") as f:
            out[name] = "read: " + repr(f.read(40))
    except OSError as e:
        out[name] = "refused: " + type(e).__name__
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def nobody():
    if os.geteuid() != 0:
        pytest.fail("this test acts as another local user: run the suite as root (CI does)")
    return pwd.getpwnam("nobody")


def test_another_local_user_runs_nothing_attaches_nowhere_and_reads_no_secret(spark_server, spark, lake, nobody):
    setting = f"spark.sql.catalog.{lake.catalog_name}.uri"
    assert spark.conf.get(setting)  # the test's own session holds the lake's settings
    server_pid = spark_server.pid
    assert server_pid is not None
    args = {
        "url": spark_server.url,
        "port": spark_server.port,
        "uid": nobody.pw_uid,
        "gid": nobody.pw_gid,
        "session": spark.session_id,
        "user": spark.client._user_id or "",
        "setting": setting,
        "files": {
            "token": str(spark_server.token_file),
            "settings file": str(spark_server.workdir / "spark-connect.properties"),
            "server environment": f"/proc/{server_pid}/environ",
        },
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT / "plugins"), str(ROOT))), "HOME": "/tmp"}
    out = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, json.dumps(args)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT ")).split(" ", 1)[1])
    print(json.dumps(seen, indent=1))
    ran = {k: v for k, v in seen.items() if not v.startswith("refused: ")}
    assert ran == {}, f"another local user got through: {ran}"
    for way in ("code", "guessed token", "attach"):
        assert "UNAUTHENTICATED" in seen[way] or "authenticat" in seen[way].lower(), (way, seen[way])


def test_a_listener_of_another_user_gets_no_token_and_no_request(spark_server, tmp_path, nobody, monkeypatch):
    """After a reboot another user can bind the port before the server starts: the stack and its
    clients stop with an error naming it, and send it nothing."""
    from devstack.localstack import LocalSparkConnect

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    # A listener owned by `nobody`: a child that takes its uid, then binds and records what arrives.
    listener = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, socket, sys\n"
            f"os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})\n"
            f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', {port}))\n"
            "s.listen(); print('listening', flush=True)\n"
            "while True:\n"
            "    c, _ = s.accept(); c.settimeout(5)\n"
            "    try:\n"
            "        data = c.recv(65536)\n"
            "    except OSError:\n"
            "        data = b''\n"
            "    sys.stdout.write('GOT ' + data.hex() + '\\n'); sys.stdout.flush()\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        for line in listener.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.time() + 30
        while "listening\n" not in lines and time.time() < deadline:
            time.sleep(0.1)
        assert "listening\n" in lines, "the other user's listener did not start"
        with pytest.raises(ServerIdentityError, match=f"127.0.0.1:{port}.*uid \\[{nobody.pw_uid}\\]"):
            connect_session(f"sc://127.0.0.1:{port}")
        # The stack does not take it for its own server (nor start a second one beside it).
        with pytest.raises(ServerIdentityError):
            LocalSparkConnect(tmp_path / "sc", port).start()
        time.sleep(1)
        received = [bytes.fromhex(x.split()[1]) if len(x.split()) > 1 else b"" for x in lines if x.startswith("GOT")]
        assert not any(received), f"the other user's listener received {received}"
    finally:
        listener.kill()
        listener.wait(5)
