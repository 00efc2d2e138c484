"""How a Spark job receives its secrets: never on a command line, in a Spark conf, or a log.

The secrets of a job are a flat dict of environment-variable names to values
(CDC_CATALOG_PASSWORD, CDC_SOURCE_URI__<CONN>, AWS_*, CDC_CATALOG_SECRET_PROPERTIES).
The Airflow task resolves them from its connections and hands them over by reference:

- driver on the Airflow worker (local[*], and client mode on standalone, YARN, Kubernetes):
  a JSON file, mode 0600 in a private 0700 directory; only its path travels, in
  CDC_SECRETS_FILE. The operator deletes it when spark-submit returns.
- YARN cluster mode: the same file shipped with `--files <path>#cdc-secrets.json` (YARN
  localizes it into the driver's container); spark.yarn.appMasterEnv.CDC_SECRETS_FILE names
  the alias.
- Kubernetes cluster mode: a Kubernetes secret the user created (`python -m
  cdc_lakehouse.cli secrets write ...` then `kubectl create secret generic ...`), mounted in
  the driver pod with spark.kubernetes.driver.secrets.<name>=<mount>.
- standalone cluster mode: refused (spark-submit runs no Python application there).

The job calls load_job_secrets() first: the file's values go into os.environ, where
LakeSettings.from_env and settings.source_uri read them. See docs/secrets.md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cdc_lakehouse.secrecy import secrets_of_env

SECRETS_FILE_ENV = "CDC_SECRETS_FILE"
SECRETS_FILE_NAME = "cdc-secrets.json"
SECRETS_DIR_ENV = "CDC_SECRETS_DIR"  # where the worker writes the one-run file (default: the temp dir)
K8S_SECRET_ENV = "CDC_K8S_SECRET_NAME"
K8S_MOUNT_ENV = "CDC_K8S_SECRET_MOUNT"
K8S_DEFAULT_MOUNT = "/etc/cdc-secrets"
# Keys of the Spark connection's extra (the environment variables above override nothing: the
# connection wins, the variables are the fallback).
K8S_SECRET_EXTRA = "cdc_k8s_secret"
K8S_MOUNT_EXTRA = "cdc_k8s_secret_mount"


class SecretsTransportError(ValueError):
    """The job's secrets cannot reach its driver safely with this master and deploy mode."""


@dataclass
class SecretsTransport:
    """What the operator adds to the spark-submit it builds: all of it free of secret values."""

    kind: str  # local-file | yarn-files | k8s-secret | none
    env: dict[str, str] = field(default_factory=dict)  # for env_vars (CDC_SECRETS_FILE: a path)
    conf: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    # True when the provider would not put env_vars into the spark-submit process's own
    # environment although the driver runs in it (Kubernetes client mode): the operator then
    # exports `env` to its own process for the duration of the run.
    process_env: bool = False
    cleanup: Callable[[], None] = lambda: None


def write_secrets_file(secrets: dict[str, str], directory: str | os.PathLike | None = None) -> Path:
    """The secrets as JSON in a new 0700 directory, file mode 0600, created exclusively."""
    base = directory or os.environ.get(SECRETS_DIR_ENV) or None
    d = Path(tempfile.mkdtemp(prefix="cdc-secrets-", dir=base))  # mkdtemp: mode 0700
    path = d / SECRETS_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(secrets, f)
    return path


def remove_secrets_file(path: Path) -> None:
    """Delete the file and its private directory."""
    shutil.rmtree(path.parent, ignore_errors=True)


def transport_for(
    master: str,
    deploy_mode: str | None,
    secrets: dict[str, str],
    *,
    k8s_secret: str | None = None,
    k8s_mount: str | None = None,
) -> SecretsTransport:
    """Choose how `secrets` reach the driver of a spark-submit to `master` in `deploy_mode`."""
    cluster = (deploy_mode or "client") == "cluster"
    is_k8s, is_yarn = master.startswith("k8s://"), master.startswith("yarn")
    if cluster and is_k8s:
        name = k8s_secret or os.environ.get(K8S_SECRET_ENV)
        if not name:
            raise SecretsTransportError(
                "Kubernetes cluster mode: the driver pod reads its secrets from a Kubernetes secret. Create it "
                "(python -m cdc_lakehouse.cli secrets write --out FILE; kubectl create secret generic NAME "
                f"--from-file={SECRETS_FILE_NAME}=FILE) and name it in the Spark connection's extra "
                f'{{"{K8S_SECRET_EXTRA}": "NAME"}} or in {K8S_SECRET_ENV}; see docs/secrets.md'
            )
        mount = (k8s_mount or os.environ.get(K8S_MOUNT_ENV) or K8S_DEFAULT_MOUNT).rstrip("/")
        return SecretsTransport(
            "k8s-secret",
            env={SECRETS_FILE_ENV: f"{mount}/{SECRETS_FILE_NAME}"},
            conf={f"spark.kubernetes.driver.secrets.{name}": mount},
        )
    if cluster and not is_yarn:
        raise SecretsTransportError(
            f"deploy mode cluster on {master}: spark-submit does not run Python applications in cluster mode on "
            "a standalone cluster, and a driver there could not read a secrets file written on this worker. "
            "Use deploy mode client (the driver runs on the Airflow worker), YARN or Kubernetes; "
            "see docs/secrets.md"
        )
    if not secrets:
        return SecretsTransport("none")
    path = write_secrets_file(secrets)
    if cluster:  # YARN: the file is localized into the driver's container under its alias
        return SecretsTransport(
            "yarn-files",
            env={SECRETS_FILE_ENV: SECRETS_FILE_NAME},
            files=[f"{path}#{SECRETS_FILE_NAME}"],
            cleanup=lambda: remove_secrets_file(path),
        )
    return SecretsTransport(
        "local-file", env={SECRETS_FILE_ENV: str(path)}, process_env=is_k8s, cleanup=lambda: remove_secrets_file(path)
    )


def read_secrets_file(path: str | os.PathLike) -> dict[str, str]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of NAME: value")
    return {str(k): str(v) for k, v in data.items()}


def load_job_secrets(environ: dict[str, str] | None = None) -> list[str]:
    """Job side: put the secrets named by CDC_SECRETS_FILE into the environment; return their names.

    The file's values win over variables already set: the file is what the Airflow task
    resolved for this run, an inherited variable may be stale. Nothing to do without
    CDC_SECRETS_FILE (jobs started by hand read their usual environment). The file is left in
    place: the operator (or YARN, or Kubernetes) owns it."""
    env = os.environ if environ is None else environ
    path = env.get(SECRETS_FILE_ENV)
    if not path:
        return []
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"{SECRETS_FILE_ENV} names {path!r}, which is not a readable file "
            f"(in cluster mode: is the Kubernetes secret mounted? see docs/secrets.md)"
        )
    secrets = read_secrets_file(p)
    secrets_of_env(secrets)  # every value is secret by origin: redact() hides it from now on
    env.update(secrets)
    return sorted(secrets)


if __name__ == "__main__":  # the command that lived here (no import: the CLI is above this layer)
    import sys

    sys.exit("`python -m cdc_lakehouse.runtime.secrets write` is now `python -m cdc_lakehouse.cli secrets write`")
