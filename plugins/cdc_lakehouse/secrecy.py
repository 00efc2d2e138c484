"""What is secret, decided in one place, and how secrets are kept out of text (docs/secrets.md).

A value is secret because of where it comes from, not because of what it is called:

- a connection's password (the lake's catalog password, each source's, each serving store's),
- the AWS keys of the lake's AWS connection,
- a catalog property the user marked secret: the lake connection's extra
  `secret_catalog_properties` (or CDC_CATALOG_SECRET_PROPERTIES for a job started by hand),
- every entry of a job's secrets file (runtime.secrets).

Such a value is a `Secret`: it prints as `***`, a Spark setting holding one is set into the
running session instead of onto a JVM command line, and every Secret this process has seen is
remembered, so redact() hides it wherever it appears, whatever its key. Names still count, as a
safety net only: a setting named like a credential (`is_secret_name`) is treated as secret too,
and redact() hides the value of a `key=value` pair whose key is named like one. The settings
(settings.LakeSettings), the Spark session (runtime.session), the spark-submit backend's last-line
check (orchestration.spark_backends) and alert redaction (orchestration.alerts) all use this module.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlsplit

# Shorter values are not looked for in text by value: replacing every "abc" would garble the text
# (Airflow's own masker skips short values likewise). Their `key=value` form is still redacted.
MIN_SECRET_LENGTH = 4

# The names that hold credentials: a credentials *provider* is a class name, not a credential
# (fs.s3a.aws.credentials.provider), and `spark.sql.session.timeZone` is no session id.
SECRET_NAME = (
    r"secret|passw(?:or)?d|passphrase|pwd|token|credential(?!s?[._-]provider)|access[._-]?key"
    r"|api[._-]?key|private[._-]?key|authorization|session[._-]?(?:id|key|token)|cookie|signature"
)
_SECRET_NAME_RE = re.compile(SECRET_NAME, re.I)


def is_secret_name(name: str) -> bool:
    """True for names that hold credentials (s3.secret-access-key, header.X-Api-Key,
    header.Authorization, spark.hadoop.fs.s3a.secret.key, PGPASSWORD, ...): the safety net."""
    return bool(_SECRET_NAME_RE.search(name))


# --- the typed secret and the registry ----------------------------------------------------------

_KNOWN: dict[str, str] = {}  # value -> origin, every Secret this process has seen
_KNOWN_LOCK = threading.Lock()


@dataclass(frozen=True)
class Secret:
    """A value that is secret because of its origin ("password of connection cdc_lake", ...).

    str() and repr() show `***`, so formatting one by mistake leaks nothing and json.dumps
    refuses it; code that hands the value to its consumer (a JDBC driver, a live Spark setting)
    calls reveal(). Creating one remembers the value for redact()."""

    value: str = field(repr=False)
    origin: str

    def __post_init__(self) -> None:
        remember(self.value, self.origin)

    def __str__(self) -> str:
        return "***"

    def reveal(self) -> str:
        return self.value


def remember(value: str | None, origin: str) -> None:
    """Known secret value from now on: redact() hides it, and so does Airflow's log masker when
    Airflow is loaded in this process (the task's log then never shows it either)."""
    if not value or len(value) < MIN_SECRET_LENGTH:
        return
    with _KNOWN_LOCK:
        if value in _KNOWN:
            return
        _KNOWN[value] = origin
    if "airflow.sdk" in sys.modules:  # the Airflow worker; a Spark driver needs no Airflow
        try:
            from airflow.sdk.log import mask_secret

            mask_secret(value)
        except Exception:  # noqa: BLE001 - our own redact() still knows the value
            pass


def reveal(value: str | Secret) -> str:
    return value.reveal() if isinstance(value, Secret) else value


def reveal_all(conf: Mapping[str, str | Secret]) -> dict[str, str]:
    return {k: reveal(v) for k, v in conf.items()}


def secrets_in_value(value: str, origin: str) -> list[Secret]:
    """A secret variable's value and the secrets inside it: the values of a JSON object
    (CDC_CATALOG_SECRET_PROPERTIES), a URI's password and credential-named query parameters
    (CDC_SOURCE_URI__*, serving store URIs), which can appear in text on their own."""
    found = [Secret(value, origin)]
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            data = {}
        return found + [Secret(str(v), f"{origin} [{k}]") for k, v in data.items() if v not in (None, "")]
    if "://" in text:
        try:
            u = urlsplit(text)
            password = u.password
        except ValueError:
            return found
        if password:
            found.append(Secret(unquote(password), f"{origin} (password)"))
        found += [Secret(v, f"{origin} ({k})") for k, v in parse_qsl(u.query) if is_secret_name(k) and v]
    return found


def secrets_of_env(env: Mapping[str, str]) -> list[Secret]:
    """Every secret of a job's secrets (variable name -> value), inner ones included."""
    return [s for name, value in env.items() if value for s in secrets_in_value(value, name)]


# --- finding and redacting -----------------------------------------------------------------------


def _forms(value: str) -> set[str]:
    """How a value can appear in text: raw, URL-encoded, JSON- and Python-escaped, libpq-quoted."""
    return {
        value,
        quote(value, safe=""),
        quote_plus(value),
        json.dumps(value)[1:-1],
        repr(value)[1:-1],
        value.replace("\\", "\\\\").replace("'", "\\'"),
    }


def find_secrets(texts: Iterable[str], secrets: Iterable[Secret]) -> list[str]:
    """The origins of the secrets whose value, in any form, occurs in one of `texts`."""
    texts = [t for t in texts if t]
    return sorted(
        {
            s.origin
            for s in secrets
            if len(s.value) >= MIN_SECRET_LENGTH and any(f in t for f in _forms(s.value) for t in texts)
        }
    )


def secret_named(names: Iterable[str]) -> list[str]:
    """The names in `names` that are named like a credential."""
    return sorted(n for n in names if is_secret_name(n))


# Quoted values with backslash escapes (password='a\'b c', JSON), a JSON string inside a JSON
# string (\"...\"), and an unterminated quote (a truncated text) up to the next blank.
_QUOTED = r"\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|\\[\"'].*?\\[\"']|[\"'][^\s\"']*"
_SCHEME = r"(?:bearer|basic|digest|negotiate|token|aws4-hmac-sha256)\s+"
# Bounded name parts: a long run of word characters (base64) must not cost quadratic time.
_KEY_VALUE = re.compile(
    rf"(?i)(?P<key>[\w.-]{{0,80}}(?:{SECRET_NAME})[\w.-]{{0,80}}\\?[\"']?\s*(?:=|:|=>)\s*)"
    rf"(?P<value>{_QUOTED}|{_SCHEME}[^\s\"',;]+|[^\s&;,\"'}}\]]+)"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[\w.~+/=-]{4,}")
_URL_USERINFO = re.compile(r"(?i)(\b[a-z][a-z0-9+.\-]*://[^/\s:@]*):([^\s/]*)@")


def _mask_value(m: re.Match) -> str:
    value = m.group("value")
    if value[:1] == "\\":  # an escaped quote: keep the escaping
        return f"{m.group('key')}{value[:2]}***{value[:2]}"
    if value[:1] in "\"'":
        return f"{m.group('key')}{value[0]}***{value[0]}"
    scheme = re.match(_SCHEME, value, re.I)
    return f"{m.group('key')}{scheme.group(0) if scheme else ''}***"


def _airflow_redact(text: str) -> str:
    """What Airflow's masker knows (connection passwords the task fetched), when Airflow is loaded."""
    if "airflow.sdk" not in sys.modules:  # a Spark driver: no Airflow, nothing it masks
        return text
    try:
        from airflow.sdk.log import redact as airflow_redact

        return str(airflow_redact(text))
    except Exception:  # noqa: BLE001 - our own rules still apply
        return text


def redact(text: Any) -> str:
    """The text without secrets: every known secret value (any key, any form), then the values of
    credential-named `key=value` / `"key": "value"` pairs (quoted ones with escapes),
    `Authorization: Bearer|Basic ...`, and passwords in URIs."""
    if text is None:
        return ""
    s = _airflow_redact(str(text))
    with _KNOWN_LOCK:
        known = sorted(_KNOWN, key=len, reverse=True)  # longest first: a secret inside another
    for value in known:
        for form in sorted(_forms(value), key=len, reverse=True):
            s = s.replace(form, "***")
    s = _URL_USERINFO.sub(r"\1:***@", s)
    s = _KEY_VALUE.sub(_mask_value, s)
    return _BEARER.sub(r"\1***", s)


# --- Spark ----------------------------------------------------------------------------------------

# What Spark redacts in its UI, event logs and REST API by key (and by value): the same names.
SPARK_REDACTION_REGEX = f"(?i){SECRET_NAME}"


def is_secret_setting(key: str, value: str | Secret) -> bool:
    """A Spark setting that holds a secret: by origin (a Secret value) or, as a safety net, by name."""
    return isinstance(value, Secret) or is_secret_name(key)


def spark_redaction_regex(secret_keys: Iterable[str] = ()) -> str:
    """spark.redaction.regex: credential names, and the exact keys of the settings that are
    secret by origin only (an innocently named catalog property marked secret)."""
    own = sorted(re.escape(k) for k in secret_keys if not is_secret_name(k))
    return "|".join([SPARK_REDACTION_REGEX, *own])
