"""Keeping the tracking URI's password or token out of messages, files, params and library logs.

Secrets: the tracking URI is shown through ``txl_dist.config.redact_uri`` in every message and file;
URLs in exception texts and in params are redacted, and when the URI holds a secret, MLflow's and
urllib3's log records are filtered too. MLflow's set_terminated is not used: it prints the run's URL,
credentials included, to stdout.
"""
from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, urlsplit

from txl_dist.config import redact_uri
from txl_dist.errors import one_line


def shown_uri(uri: str) -> str:
    """The URI as it may be shown or written: redacted when it holds a password or token, else unchanged."""
    redacted = redact_uri(uri)
    # redact_uri re-assembles every URI; take its result only where it masked something (it would turn
    # sqlite:////abs/path into sqlite://abs/path).
    return redacted if "***" in redacted else uri


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_known_secrets: set[str] = set()
MIN_SECRET_LENGTH = 4
"""A shorter password is not searched for in free text (it would mask ordinary words)."""


def scrub_secrets(text: str) -> str:
    """text with every URL redacted and every known secret (from a tracking URI seen here) masked."""
    text = _URL.sub(lambda m: shown_uri(m.group(0)), text)
    for secret in _known_secrets:
        text = text.replace(secret, "***")
    return text


def _remember_secrets(uri: str) -> bool:
    """Note the password / token values of uri for scrub_secrets; True if it holds any."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return False
    secrets = []
    if parts.password:
        secrets.append(parts.password)
    elif parts.username and "***@" in redact_uri(uri):  # https://TOKEN@host/
        secrets.append(parts.username)
    redacted_query = parse_qsl(urlsplit(redact_uri(uri)).query, keep_blank_values=True)
    original_query = parse_qsl(parts.query, keep_blank_values=True)
    secrets += [value for (_, value), (_, shown) in zip(original_query, redacted_query) if shown == "***"]
    _known_secrets.update(s for s in secrets if len(s) >= MIN_SECRET_LENGTH)
    return bool(secrets)


class _SecretScrubber(logging.Filter):
    """Rewrites a log record's text (and its traceback) through scrub_secrets; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's business, not ours
            return True
        scrubbed = scrub_secrets(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub_secrets(logging.Formatter().formatException(record.exc_info))
        return True


_SCRUBBER = _SecretScrubber()


def _scrub_library_logs() -> None:
    """Attach the scrubber to MLflow's and urllib3's loggers and handlers: their exceptions quote the
    request URL, credentials included (e.g. the system metrics sampler's "Failed to get mlflow run")."""
    names = {"mlflow", "urllib3", "requests"}
    names.update(n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in names)
    for name in sorted(names):
        lib_logger = logging.getLogger(name)
        for target in (lib_logger, *lib_logger.handlers):
            if _SCRUBBER not in target.filters:
                target.addFilter(_SCRUBBER)


_SQLALCHEMY_PREAMBLE = "(raised as a result of Query-invoked autoflush"


def _one_line(exc: BaseException) -> str:
    """MLflow errors can carry whole HTML pages and the request URL; a warning gets the first line,
    bounded, with secrets masked."""
    return f"{type(exc).__name__}: {_first_line(str(exc))}"


def _first_line(text: str) -> str:
    """The first line of an error text, bounded, with secrets masked; SQLAlchemy's note on where a failed flush
    was raised is passed over: the line after it says what failed ("(sqlite3.OperationalError) database or disk
    is full")."""
    lines = scrub_secrets(text).strip().splitlines()
    while len(lines) > 1 and lines[0].startswith(_SQLALCHEMY_PREAMBLE):
        lines = lines[1:]
    return one_line(RuntimeError("\n".join(lines)), limit=300)


class _StoreErrorTracebacks(logging.Filter):
    """MLflow's log records of a failed store write, made short. The SQL store logs a traceback of ~80 lines per
    database error (on a full disk, one per metrics batch) and raises the same error to the caller, which
    reports it in one line: that record is dropped. The system metrics sampler logs the error's whole text
    (the SQL statement and its parameters): its record keeps one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("SQLAlchemy database error"):
            return False
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's business, not ours
            return True
        if "\n" in message:
            head, sep, rest = message.partition(": ")
            record.msg = f"{head}: {_first_line(rest)}" if sep and "\n" not in head else _first_line(message)
            record.args = record.exc_info = record.exc_text = None
        return True


_STORE_FILTER = _StoreErrorTracebacks()
_STORE_LOGGERS = ("mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor")


def _quiet_store_tracebacks() -> None:
    """Attach _StoreErrorTracebacks to the loggers of MLflow's SQL-store sessions and of its system metrics
    sampler (idempotent)."""
    for name in _STORE_LOGGERS:
        store_logger = logging.getLogger(name)
        if _STORE_FILTER not in store_logger.filters:
            store_logger.addFilter(_STORE_FILTER)
