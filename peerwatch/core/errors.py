"""Exceptions a user can see. Each carries its fields as attributes and pickles."""

from __future__ import annotations

from typing import Any, Dict, Optional


class PeerwatchError(Exception):
    """Base class of peerwatch's own errors."""


class ConfigError(PeerwatchError, ValueError):
    """An option has a bad value. ``option``, ``value`` and ``source`` say which and from where."""

    def __init__(self, option: str, value: Any, source: str, reason: str) -> None:
        super().__init__(option, value, source, reason)
        self.option = option
        self.value = value
        self.source = source
        self.reason = reason

    def __str__(self) -> str:
        return f"peerwatch option {self.option}={self.value!r} (from {self.source}): {self.reason}"


class RunDirError(PeerwatchError, OSError):
    """The run directory cannot be trusted or used; ``path`` and ``reason`` say why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"peerwatch run directory {self.path}: {self.reason}"


class PeerFailure(SystemExit):
    """Raised in the main thread of a surviving rank, inside ``watch()``, when a peer failed.

    It derives from :class:`SystemExit` on purpose: a training loop's ``except Exception``
    does not swallow it, and when nobody catches it the process exits with ``code``,
    the failing rank's exit code, without a misleading traceback of its own.

    Attributes: ``rank``, ``pid``, ``cause`` (``exception``, ``exit``, ``signal``,
    ``vanished``, ...), ``exit_code`` (the code this rank exits with), ``signal``
    (signal name or ``None``), ``host``, ``detail`` (one readable line).
    """

    def __init__(
        self,
        rank: Optional[int] = None,
        cause: Optional[str] = None,
        exit_code: Optional[int] = None,
        *,
        pid: Optional[int] = None,
        signal: Optional[str] = None,
        host: Optional[str] = None,
        detail: str = "",
    ) -> None:
        fields = self._bound
        if fields is not None and rank is None and cause is None and exit_code is None:
            # Raised asynchronously into the main thread (no arguments travel that way):
            # a class made by bound_to() carries the verdict's fields.
            rank, cause, exit_code = fields["rank"], fields["cause"], fields["exit_code"]
            pid, signal, host, detail = fields["pid"], fields["signal"], fields["host"], fields["detail"]
        code = 1 if exit_code is None else exit_code
        super().__init__(code)
        self.rank = rank
        self.cause = cause
        self.exit_code = code
        self.pid = pid
        self.signal = signal
        self.host = host
        self.detail = detail

    _bound: Optional[Dict[str, Any]] = None

    @classmethod
    def from_verdict(cls, verdict: Any) -> PeerFailure:
        """The PeerFailure for a verdict (any object with its fields)."""
        return cls(
            verdict.rank, verdict.cause, verdict.exit_code, pid=verdict.pid, signal=verdict.signal,
            host=verdict.host, detail=verdict.detail,
        )

    @classmethod
    def bound_to(cls, verdict: Any) -> type:
        """A subclass whose no-argument construction carries ``verdict``'s fields: what
        ``PyThreadState_SetAsyncExc`` raises in the main thread (it takes a class)."""
        fields = {k: getattr(verdict, k) for k in ("rank", "cause", "exit_code", "pid", "signal", "host", "detail")}
        return type(cls.__name__, (cls,), {"_bound": fields, "__module__": cls.__module__, "__qualname__": cls.__qualname__})

    def __reduce__(self) -> Any:
        kwargs = {"pid": self.pid, "signal": self.signal, "host": self.host, "detail": self.detail}
        return (_rebuild_peer_failure, (self.rank, self.cause, self.exit_code, kwargs))

    def __str__(self) -> str:
        if self.cause == "interrupted":  # no rank failed: the job was interrupted from outside (peerwatch.core.records)
            text = f"the job was interrupted; this rank exits with code {self.exit_code}"
        else:
            text = f"rank {self.rank} failed ({self.cause}); this rank exits with code {self.exit_code}"
        return f"{text}: {self.detail}" if self.detail else text


# Users meet these as peerwatch.X (tracebacks, repr, docs); they pickle by that name too.
for _cls in (PeerwatchError, ConfigError, RunDirError, PeerFailure):
    _cls.__module__ = "peerwatch"
del _cls


def _rebuild_peer_failure(rank: Any, cause: Any, exit_code: Any, kwargs: Any) -> PeerFailure:
    return PeerFailure(rank, cause, exit_code, **kwargs)


__all__ = ["ConfigError", "PeerFailure", "PeerwatchError", "RunDirError"]
