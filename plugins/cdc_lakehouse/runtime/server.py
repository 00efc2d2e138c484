"""The job server: one long-lived Spark application that Airflow tasks submit jobs to.

Why: on a 2-core machine every spark-submit pays a JVM, Spark's start, the Iceberg catalog and
a cold JIT before its first row, for an ingest that does a few seconds of work (BENCHMARKS.md,
"Job server"). Spark Connect would be the standard answer, but its server jar is not obtainable
without Maven Central (README, "Performance"); this is the same idea for a single machine.

- `python -m cdc_lakehouse.runtime.server start` runs the server: a SparkSession with the
  lake's settings (local master only: on YARN or Kubernetes, tasks keep spark-submit) and a Unix
  socket in a 0700 directory. Started and stopped by `make demo` and `make airflow`.
- A task with CDC_SPARK_SERVER=<socket> in its environment (CdcSparkSubmitOperator) sends
  {job, argv, env}: the same job name and arguments spark-submit would get, and the same
  environment, where secrets travel only by reference (CDC_SECRETS_FILE, a 0600 file's path).
- Jobs run one at a time, each in a new session of the one SparkContext (runtime.session
  share_session): own SQL settings, temporary views and Iceberg catalog instances, so nothing a
  job sets or caches reaches the next one. Around each job the server sets the job's environment
  and restores its own afterwards, drops every cached frame and checkpoint, and streams the
  job's stdout, stderr and log records back to the task, then its exit code.
- Jobs run the server's copy of the package: a request built from a different package
  (fingerprint of the shipped sources) is refused, naming the restart.
- A client that goes away (task killed) cancels the job's Spark work.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

SERVER_ENV = "CDC_SPARK_SERVER"  # the socket path; set in a task's environment to use the server
EXIT_MARK = "\x00CDC_EXIT "  # the last line of a reply: the job's exit code
log = logging.getLogger("cdc_lakehouse.runtime.server")


class JobServerError(RuntimeError):
    """The job server cannot run the job (not running, another package, unknown job)."""


def default_socket() -> Path:
    from cdc_lakehouse.settings import local_paths

    return local_paths()["local"] / "spark-server" / "jobs.sock"


def package_fingerprint() -> str:
    """Hash of the package's shipped sources (names, sizes, mtimes): what the server runs."""
    from cdc_lakehouse.runtime.packaging import NOT_SHIPPED, PACKAGE_DIR

    h = hashlib.sha256()
    for p in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = p.relative_to(PACKAGE_DIR)
        if "__pycache__" in p.parts or rel.parts[0] in NOT_SHIPPED:
            continue
        st = p.stat()
        h.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- server


def _client_gone(conn: socket.socket) -> bool:
    """True when the client closed its end (it sends nothing after its request)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class _Reply(io.TextIOBase):
    """A text stream into the client's socket; writes after the client left are dropped."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.gone = conn, False
        self.finished = threading.Event()  # the job ended: an EOF after this cancels nothing
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self._lock:
            if not self.gone:
                try:
                    self.conn.sendall(s.encode("utf-8", "replace"))
                except OSError:
                    self.gone = True
        return len(s)


class _CurrentStderr(io.TextIOBase):
    """Log records go wherever sys.stderr points now: into the running job's reply."""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def _server_log(msg: str) -> None:
    """The server's own log (its process's stderr), whatever a job redirected."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} job server: {msg}", file=sys.__stderr__, flush=True)


class FifoLock:
    """A lock granted in arrival order. threading.Lock is not fair: with jobs queued, a job could
    wait behind ones that arrived after it, however long."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket that holds the lock
        self._abandoned: set[int] = set()  # tickets whose waiter left (an exception while waiting)

    @property
    def waiting(self) -> int:
        """Holders and waiters: 0 when free."""
        with self._cond:
            return self._next - self._serving - len(self._abandoned)

    def __enter__(self) -> None:
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            try:
                self._cond.wait_for(lambda: self._serving == ticket)
            except BaseException:
                # Interrupted while waiting: its turn must not stall everyone behind it.
                if self._serving == ticket:
                    self._advance()
                else:
                    self._abandoned.add(ticket)
                raise

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._advance()

    def _advance(self) -> None:
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()


class JobServer:
    def __init__(self, spark, sock_path: Path, jobs: dict[str, Callable[[list[str]], int]] | None = None) -> None:
        from cdc_lakehouse.runtime.jobs import JOBS

        self.spark, self.sock_path = spark, Path(sock_path)
        self.jobs = dict(JOBS if jobs is None else jobs)
        self.fingerprint = package_fingerprint()
        self._run_lock = FifoLock()  # one job at a time: os.environ and stdout are the process's
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self.jobs_run = 0

    def bind(self) -> None:
        d = self.sock_path.parent
        # Only this user may connect (a request names a secrets file to read): the socket's folder
        # is created private, or must already be, never made so (it could be /tmp).
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise JobServerError(
                f"the job server's socket folder {d} must be private to this user (mode 0700): chmod 700 {d}"
            )
        if self.sock_path.exists():
            if status(self.sock_path) is not None:
                raise JobServerError(f"a job server already listens on {self.sock_path}")
            self.sock_path.unlink()  # a dead server's
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.sock_path))
        os.chmod(self.sock_path, 0o600)
        s.listen(16)
        s.settimeout(0.5)
        self._listener = s

    def serve_forever(self) -> None:
        from cdc_lakehouse.runtime.session import share_session

        if self._listener is None:
            self.bind()
        share_session(self.spark)
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()  # type: ignore[union-attr]
                except TimeoutError:
                    continue
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        finally:
            self._listener.close()  # type: ignore[union-attr]
            with self._run_lock:  # the running job ends first; queued ones are refused (_run)
                share_session(None)
            with contextlib.suppress(FileNotFoundError):
                self.sock_path.unlink()

    def start_thread(self) -> threading.Thread:
        """Serve on a background thread (tests: the session's SparkSession as the server's)."""
        self.bind()
        t = threading.Thread(target=self.serve_forever, name="cdc-job-server", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()

    def _handle(self, conn: socket.socket) -> None:
        reply = _Reply(conn)
        try:
            with conn.makefile("r", encoding="utf-8") as f:
                req = json.loads(f.readline() or "{}")
            if req.get("op") == "status":
                st = {
                    "fingerprint": self.fingerprint,
                    "jobs_run": self.jobs_run,
                    "jobs": sorted(self.jobs),
                    "running_or_queued": self._run_lock.waiting,
                }
                reply.write(json.dumps(st) + "\n")
                return
            if req.get("op") == "shutdown":
                self.stop()
                reply.write("stopping\n")
                return
            rc = self._run(req, reply, conn)
            reply.write(f"\n{EXIT_MARK}{rc}\n")
        except Exception:  # noqa: BLE001 - reported to the client, the server stays up
            reply.write(f"job server: {traceback.format_exc()}\n{EXIT_MARK}2\n")
        finally:
            # shutdown, not only close: it ends the watcher's recv and sends the client its EOF.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _run(self, req: dict[str, Any], reply: _Reply, conn: socket.socket) -> int:
        job, argv, env = req.get("job"), list(req.get("argv") or []), dict(req.get("env") or {})
        if req.get("fingerprint") != self.fingerprint:
            raise JobServerError(
                f"the job server at {self.sock_path} runs another version of the package "
                f"({self.fingerprint}, the task has {req.get('fingerprint')}): restart it "
                "(python -m cdc_lakehouse.runtime.server restart)"
            )
        if job not in self.jobs:
            raise JobServerError(f"unknown job {job!r}; the server runs {sorted(self.jobs)}")
        with self._run_lock:
            if self._stop.is_set():
                raise JobServerError(f"the job server at {self.sock_path} is stopping; {job} did not run")
            if _client_gone(conn):  # killed while it waited for the job before it
                _server_log(f"{job} {' '.join(argv)}: its client left before it started; not run")
                return 2
            # Spark work of this request only, whatever job groups the job sets: what a client that
            # leaves cancels (a stale watcher cannot reach the next job's).
            tag = f"cdc-job-{uuid.uuid4().hex[:12]}"
            self.spark.sparkContext.addJobTag(tag)
            watcher = threading.Thread(target=self._cancel_when_gone, args=(conn, reply, tag), daemon=True)
            saved_env, t, rc = dict(os.environ), time.time(), 2
            os.environ.update(env)
            try:
                with contextlib.redirect_stdout(reply), contextlib.redirect_stderr(reply):
                    watcher.start()
                    log.info("job server: %s %s", job, " ".join(argv))
                    rc = self._call(self.jobs[job], argv)
                    return rc
            finally:
                self.spark.sparkContext.removeJobTag(tag)
                reply.finished.set()
                os.environ.clear()
                os.environ.update(saved_env)  # the job's secrets leave with it
                self._forget_cached()
                self.jobs_run += 1
                _server_log(f"{job} {' '.join(argv)}: exit {rc} in {time.time() - t:.1f}s")

    @staticmethod
    def _call(fn: Callable[[list[str]], int], argv: list[str]) -> int:
        try:
            return int(fn(argv) or 0)
        except SystemExit as e:  # argparse and config errors exit; the server does not
            if e.code not in (None, 0) and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:  # noqa: BLE001 - the job failed, the server did not
            traceback.print_exc()
            return 1

    def _cancel_when_gone(self, conn: socket.socket, reply: _Reply, tag: str) -> None:
        """The client sends nothing after its request: EOF means it was killed."""
        with contextlib.suppress(OSError):
            while conn.recv(1024):
                pass
        if not reply.finished.is_set():
            reply.gone = True
            _server_log("the client left; cancelling the job's Spark jobs until it ends")
        # Until the job returns: Spark cancels running jobs only, and the job's next action would
        # start a new one.
        while not reply.finished.wait(1.0):
            self.spark.sparkContext.cancelJobsWithTag(tag)

    def _forget_cached(self) -> None:
        """Frames a job persisted or checkpointed live in the shared context: drop them all."""
        try:
            self.spark.catalog.clearCache()
            for rdd in list(self.spark.sparkContext._jsc.getPersistentRDDs().values()):
                rdd.unpersist(False)
        except Exception as exc:  # noqa: BLE001 - the job's result stands; the memory stays held
            _server_log(f"could not drop the last job's cached frames: {exc}")


def serve(sock_path: Path, master: str) -> int:
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.secrets import load_job_secrets
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    if not master.startswith("local"):
        raise SystemExit(f"the job server runs a local master only, not {master!r}: tasks use spark-submit there")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().handlers[0].setStream(_CurrentStderr())  # type: ignore[attr-defined]
    load_job_secrets()
    lake = LakeSettings.from_env()
    t = time.time()
    spark = get_spark("cdc-job-server", lake, master=master)
    ensure_meta_tables(spark, lake)
    server = JobServer(spark, sock_path)
    server.bind()
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__)  # `kill -USR1`: every thread's stack in the log
    log.info("job server: ready in %.1fs on %s (package %s)", time.time() - t, sock_path, server.fingerprint)
    print(f"ready {sock_path}", flush=True)
    server.serve_forever()
    spark.stop()
    return 0


# ---------------------------------------------------------------- client


def _connect(sock_path: str | os.PathLike, timeout: float | None = None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(sock_path))
    except OSError as e:
        s.close()
        raise JobServerError(
            f"no job server at {sock_path} ({e.strerror or e}): start it "
            f"(python -m cdc_lakehouse.runtime.server start) or unset {SERVER_ENV} to use spark-submit"
        ) from e
    return s


def submit(
    sock_path: str | os.PathLike, job: str, argv: list[str], env: dict[str, str], on_line: Callable[[str], None]
) -> int:
    """Run `job argv` on the server; every output line goes to on_line; returns its exit code."""
    s = _connect(sock_path)
    try:
        req = {"job": job, "argv": argv, "env": env, "fingerprint": package_fingerprint()}
        s.sendall((json.dumps(req) + "\n").encode())
        rc: int | None = None
        for raw in s.makefile("r", encoding="utf-8", errors="replace"):
            line = raw.rstrip("\n")
            if line.startswith(EXIT_MARK):
                rc = int(line[len(EXIT_MARK) :])
            elif line:
                on_line(line)
    finally:
        s.close()
    if rc is None:
        raise JobServerError(f"the job server at {sock_path} closed the connection before {job} ended (it died?)")
    return rc


def _request(sock_path: str | os.PathLike, op: str) -> str:
    s = _connect(sock_path, timeout=10)
    try:
        s.sendall((json.dumps({"op": op}) + "\n").encode())
        return s.makefile("r").read()
    finally:
        s.close()


def status(sock_path: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return json.loads(_request(sock_path, "status"))
    except JobServerError:
        return None


def start_background(
    sock_path: Path, log_file: Path, master: str = "local[*]", timeout: float = 180, env: dict[str, str] | None = None
) -> None:
    """Start a server process (environment: ours, or `env`) and wait until it accepts jobs."""
    import subprocess

    from cdc_lakehouse.runtime.packaging import PACKAGE_DIR

    env = dict(os.environ if env is None else env)
    # The server imports this package (as the Airflow worker does), wherever it was started from.
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent), *filter(None, [env.get("PYTHONPATH")])])
    log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the socket's folder too: private
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cdc_lakehouse.runtime.server",
                "serve",
                "--socket",
                str(sock_path),
                "--master",
                master,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    deadline = time.time() + timeout
    while time.time() < deadline:
        if status(sock_path) is not None:
            return
        if proc.poll() is not None:
            raise JobServerError(f"the job server exited with {proc.returncode}; see {log_file}")
        time.sleep(0.5)
    proc.terminate()
    raise JobServerError(f"the job server did not start within {timeout:.0f}s; see {log_file}")


def shutdown(sock_path: Path, timeout: float = 60) -> None:
    with contextlib.suppress(JobServerError):
        _request(sock_path, "shutdown")
    deadline = time.time() + timeout
    while sock_path.exists() and time.time() < deadline:
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cdc_lakehouse.runtime.server")
    p.add_argument("cmd", choices=["start", "stop", "restart", "status", "serve"])
    p.add_argument("--socket", default=None, help="socket path (default: .local/spark-server/jobs.sock)")
    p.add_argument("--master", default=os.environ.get("CDC_SPARK_MASTER", "local[*]"))
    a = p.parse_args(argv)
    sock = Path(a.socket) if a.socket else default_socket()
    if a.cmd == "serve":
        return serve(sock, a.master)
    if a.cmd in ("stop", "restart"):
        shutdown(sock)
    if a.cmd in ("start", "restart"):
        st = status(sock)
        if st is not None and st.get("fingerprint") != package_fingerprint():
            shutdown(sock)  # it runs another version of the package: its jobs would be refused
            st = None
        if st is None:
            start_background(sock, sock.parent / "server.log", a.master)
        print(f"job server on {sock}: export {SERVER_ENV}={sock} for tasks to use it")
    if a.cmd == "status":
        st = status(sock)
        print(f"job server on {sock}: {st if st else 'not running'}")
        return 0 if st else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
