"""Configuration: keyword arguments > ``PEERWATCH_*`` environment > defaults.

Resolved once into a frozen :class:`Config`; every bad value is reported with the
option's name and where the value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import stat
from typing import Any, Callable, List, Mapping, Optional, Tuple

from .errors import ConfigError

GRACE_S = 5.0  # between SIGTERM and SIGKILL; also how long a rank's main thread may take to leave
ACK_WINDOW_S = 0.5  # how long a peer has to acknowledge a verdict before we signal it
HEARTBEAT_INTERVAL_S = 1.0  # liveness/progress record; the slow path, not the detector
PARENT_WAIT_S = 0.1  # a dead rank's parent may know its exit status: let it speak first
DEFAULT_EXIT_CODE = 1  # exit code of torn-down ranks when the failing rank's code is unknown
PEER_TIMEOUT_S = 30.0  # another host (or the store) silent for this long: it is lost
ON_VERDICT_TIMEOUT_S = 10.0  # the on_verdict hook's bound, from its start (whatever grace is)

# The largest value of each duration. Every wait of the watcher is a poll(2) in
# milliseconds (a C int: at most 2**31 - 1 ms, 24.8 days), an Event.wait (at most
# threading.TIMEOUT_MAX) or faulthandler's timer, and several are sums of options
# (grace + ack_window, hang_timeout + 2 heartbeats): a longer value would pass here and
# kill the watcher later, leaving the rank unprotected. Together they stay far below.
MINUTE_S, HOUR_S, DAY_S, WEEK_S = 60.0, 3600.0, 86400.0, 604800.0
MAX_SECONDS = {
    "grace": DAY_S,
    "ack_window": HOUR_S,
    "heartbeat_interval": HOUR_S,
    "parent_wait": HOUR_S,
    "startup_timeout": WEEK_S,
    "hang_timeout": WEEK_S,
    "hang_warn": WEEK_S,
    "gil_timeout": WEEK_S,
    "peer_timeout": WEEK_S,
    "on_verdict_timeout": HOUR_S,
}


@dataclasses.dataclass(frozen=True)
class HangSetting:
    """``hang_timeout`` or ``hang_warn``: off, auto (the threshold learnt from the job,
    peerwatch.hangs.diagnose), or a fixed number of seconds. Parsed once, by :meth:`Config.resolve`."""

    auto: bool = False
    seconds: Optional[float] = None  # the fixed threshold; None: off, or auto

    @property
    def on(self) -> bool:
        return self.auto or self.seconds is not None


# Environment variables that carry the rank, in order of preference.
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything peerwatch needs to know, resolved once.

    ``rank`` is ``None`` only when nothing says which rank this is; peerwatch then
    assumes rank 0 (a launcher's first process, e.g. Lightning's rank 0 before it
    spawns the others). ``sources`` maps each option to where its value came from.
    ``startup_timeout`` and ``gil_timeout`` are ``None`` when off (0); ``hang_timeout`` and ``hang_warn`` are
    a :class:`HangSetting` (off, auto or seconds).
    """

    enabled: bool = True
    run_dir: Optional[str] = None
    rank: Optional[int] = None
    world_size: Optional[int] = None
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    grace: float = GRACE_S
    ack_window: float = ACK_WINDOW_S
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S
    parent_wait: float = PARENT_WAIT_S
    exit_code: int = DEFAULT_EXIT_CODE
    startup_timeout: Optional[float] = None  # None: off
    startup_action: str = "warn"  # or "fail": what to do about ranks missing at startup_timeout
    thread_exceptions: str = "record"  # or "fail": an uncaught exception in another thread fails the rank
    hang_timeout: HangSetting = HangSetting()  # no rank made progress (beat(), collectives) for this long: hung
    hang_warn: HangSetting = HangSetting(auto=True)  # nothing moved for this long: a diagnosis is logged
    gil_timeout: Optional[float] = None  # the watcher could not run for this long: faulthandler ends the rank
    stragglers: bool = True  # name a rank its peers keep waiting for (docs/stragglers.md); needs hang_warn or hang_timeout
    strict: bool = False
    use_pidfd: bool = True
    # A surviving rank's exception that follows a peer's failure (gloo's "Connection reset
    # by peer") goes to its stack file; verbose prints its traceback too (docs/report.md).
    verbose: bool = False
    # Beyond one host (docs/multi-node.md).
    store: Any = None  # "host:port", a torch.distributed Store, "off"; None: the job's own (MASTER_ADDR/PORT)
    run_id: Optional[str] = None  # names the job on every host; None: from the launcher's environment
    peer_timeout: float = PEER_TIMEOUT_S
    shared_fs: str = "auto"  # "on"/"off": is the run directory shared by the hosts? auto: the mount table says
    # Signs what peerwatch writes to the store (docs/security.md); from store_secret or store_secret_file.
    store_secret: Optional[bytes] = dataclasses.field(default=None, repr=False)
    # Run once per host after a verdict (docs/notify.md): a shell command, or (a keyword
    # argument only) a callable ``f(verdict, report_path)``.
    on_verdict: Any = None
    on_verdict_timeout: float = ON_VERDICT_TIMEOUT_S  # its bound: then its whole process tree is ended
    sources: Tuple[Tuple[str, str], ...] = ()

    @property
    def effective_rank(self) -> int:
        return 0 if self.rank is None else self.rank

    def source_of(self, option: str) -> str:
        return dict(self.sources).get(option, "default")

    @property
    def diagnoses_hangs(self) -> bool:
        """A diagnosis when nothing moves: hang_warn is on, or hang_timeout=auto ends the job at one."""
        return self.hang_warn.on or self.hang_timeout.auto

    @property
    def reads_collectives(self) -> bool:
        """torch's collective counters are read: for the diagnosis, or as progress for hang_timeout."""
        return self.hang_timeout.on or self.diagnoses_hangs

    @classmethod
    def resolve(cls, options: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
        """Build a Config from keyword options, then ``PEERWATCH_*`` variables, then defaults.

        Raises :class:`ConfigError` naming the option, the value and its source.
        """
        env = os.environ if env is None else env
        unknown = set(options) - _OPTION_NAMES
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(name, options[name], "keyword argument", "unknown option")
        values, sources = _given_values(options, env)
        _fold_aliases(values, sources, options, env)
        _launcher_ranks(values, sources, env)
        beat = values.get("heartbeat_interval", HEARTBEAT_INTERVAL_S)
        if "peer_timeout" not in values and isinstance(beat, float) and 2 * beat > PEER_TIMEOUT_S:
            # The default follows a slow heartbeat (up to the documented maximum, an hour)
            # rather than refuse it; a peer_timeout the user set is checked as given.
            values["peer_timeout"] = 2 * beat
            sources["peer_timeout"] = "default: twice heartbeat_interval"
        config = cls(**values, sources=tuple(sorted(sources.items())))
        config._validate()
        return config

    def _validate(self) -> None:
        hook, beat = self.on_verdict_timeout, self.heartbeat_interval
        hang, gil = self.hang_timeout.seconds, self.gil_timeout
        twice_beat = f"at least twice heartbeat_interval ({beat:g}s)"
        # (option, its value, broken?, why), in the order checked: the first broken one is raised.
        rules: Tuple[Tuple[str, Any, bool, str], ...] = (
            ("on_verdict_timeout", hook, hook <= 0, "must be above 0 (the hook's bound)"),
            ("heartbeat_interval", beat, beat <= 0, "must be above 0"),
            ("hang_timeout", hang, hang is not None and hang < 2 * beat, f"must be 0 (off) or {twice_beat}"),
            ("gil_timeout", gil, gil is not None and gil < 2 * beat, f"must be 0 (off) or {twice_beat}"),
            ("rank", self.rank, self.world_size is not None and self.rank is not None and self.rank >= self.world_size,
             f"rank must be below world_size={self.world_size} ({self.source_of('world_size')})"),
            ("peer_timeout", self.peer_timeout, self.peer_timeout < 2 * beat, f"must be {twice_beat}"),
            ("world_size", 0, self.world_size == 0, "must be at least 1"),
        )
        for option, value, broken, why in rules:
            if broken:
                raise ConfigError(option, value, self.source_of(option), why)


def _non_negative_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected a whole number, got a boolean")
    value = int(raw)
    if isinstance(raw, float) and raw != value:
        raise ValueError("expected a whole number")
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _exit_code(raw: Any) -> int:
    value = _non_negative_int(raw)
    if not 1 <= value <= 255:
        raise ValueError("must be an exit status from 1 to 255")
    return value


def _seconds(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError("expected a number of seconds, got a boolean")
    value = float(raw)
    if not (value >= 0.0 and value < float("inf")):
        raise ValueError("must be a finite number of seconds, 0 or more")
    return value


def _duration(option: str) -> Callable[[Any], float]:
    """A parser of seconds, 0 to ``MAX_SECONDS[option]``."""
    limit = MAX_SECONDS[option]

    def parse(raw: Any) -> float:
        value = _seconds(raw)
        if value > limit:
            raise ValueError(
                f"must be at most {limit:g}s ({_spoken(limit)}): the watcher's waits are poll(2) timeouts "
                "in milliseconds and timers of bounded range, and a longer one would stop the watcher"
            )
        return value

    return parse


def _off_or_duration(option: str) -> Callable[[Any], Optional[float]]:
    """Seconds, 0 to ``MAX_SECONDS[option]``; 0 is off (None)."""
    seconds = _duration(option)
    return lambda raw: seconds(raw) or None


def _hang(option: str, off: str) -> Callable[[Any], HangSetting]:
    """Seconds, ``auto`` (the threshold learnt from the job) or ``off`` (also 0)."""
    seconds = _off_or_duration(option)

    def parse(raw: Any) -> HangSetting:
        word = raw.strip().lower() if isinstance(raw, str) else None
        if word in ("auto", off):
            return HangSetting(auto=word == "auto")
        return HangSetting(seconds=seconds(raw))

    return parse


def _spoken(seconds: float) -> str:
    for unit, name in ((WEEK_S, "a week"), (DAY_S, "a day"), (HOUR_S, "an hour"), (MINUTE_S, "a minute")):
        if seconds == unit:
            return name
    return f"{seconds:g} seconds"


SECRET_MIN_BYTES = 16  # a store secret shorter than this is refused: it could be guessed
SECRET_SHOWN = "<hidden>"  # what an error says instead of a store secret


def _secret(raw: Any) -> bytes:
    value = raw.encode() if isinstance(raw, str) else raw
    if not isinstance(value, bytes):
        raise ValueError("expected a string or bytes")
    if len(value) < SECRET_MIN_BYTES:
        raise ValueError(f"must be at least {SECRET_MIN_BYTES} bytes (e.g. `openssl rand -hex 32`)")
    return value


def _secret_file(raw: Any) -> bytes:
    """The secret in the file at ``raw`` (trailing line breaks dropped). The file must be
    this user's (or root's), and neither writable by others nor readable by everyone."""
    path = _path(raw)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("is not a regular file")
            if st.st_uid not in (os.geteuid(), 0):
                raise ValueError(f"belongs to uid {st.st_uid}, not to this user")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH):
                raise ValueError(f"has mode {stat.S_IMODE(st.st_mode):o}: others may read or change it (chmod 600)")
            data = f.read(4097)
    except OSError as e:
        raise ValueError(f"cannot be read ({e.strerror})") from None
    if len(data) > 4096:
        raise ValueError("is over 4096 bytes: not a secret file")
    try:
        return _secret(data.rstrip(b"\r\n"))
    except ValueError as e:
        raise ValueError(f"holds a secret that {e}") from None


def _flag(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _choice(*words: str) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        text = str(raw).strip().lower()
        if text not in words:
            raise ValueError(f"expected {' or '.join(words)}")
        return text

    return parse


def _store(raw: Any) -> Any:
    if not isinstance(raw, str):
        if not all(hasattr(raw, m) for m in ("set", "get", "compare_set")):
            raise ValueError("expected 'host:port', 'off', or a torch.distributed Store")
        return raw
    text = raw.strip()
    if text.lower() in ("off", "0", "no", "false", "none"):
        return "off"
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected 'host:port' (e.g. node0:29500) or 'off'")
    return f"{host.strip('[]')}:{int(port)}"


def _run_id(raw: Any) -> str:
    text = str(raw).strip()
    if not text or len(text) > 200:
        raise ValueError("must be 1 to 200 characters")
    return text


def _shared_fs(raw: Any) -> str:
    text = str(raw).strip().lower()
    if text in ("auto",):
        return "auto"
    try:
        return "on" if _flag(text) else "off"
    except ValueError:
        raise ValueError("expected auto, on or off") from None


def _on_verdict(raw: Any) -> Any:
    if callable(raw):
        return raw
    if not isinstance(raw, str):
        raise ValueError("expected a shell command (a string) or a callable f(verdict, report_path)")
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw


def _path(raw: Any) -> str:
    text = os.fspath(raw)
    if not text:
        raise ValueError("must not be empty")
    return os.path.abspath(text)


_OPTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "disable": ("PEERWATCH_DISABLE", _flag),
    "run_dir": ("PEERWATCH_DIR", _path),
    "rank": ("PEERWATCH_RANK", _non_negative_int),
    "world_size": ("PEERWATCH_WORLD_SIZE", _non_negative_int),
    "local_rank": ("PEERWATCH_LOCAL_RANK", _non_negative_int),
    "local_world_size": ("PEERWATCH_LOCAL_WORLD_SIZE", _non_negative_int),
    "grace": ("PEERWATCH_GRACE", _duration("grace")),
    "ack_window": ("PEERWATCH_ACK_WINDOW", _duration("ack_window")),
    "heartbeat_interval": ("PEERWATCH_HEARTBEAT", _duration("heartbeat_interval")),
    "parent_wait": ("PEERWATCH_PARENT_WAIT", _duration("parent_wait")),
    "exit_code": ("PEERWATCH_EXIT_CODE", _exit_code),
    "startup_timeout": ("PEERWATCH_STARTUP_TIMEOUT", _off_or_duration("startup_timeout")),
    "startup_action": ("PEERWATCH_STARTUP_ACTION", _choice("warn", "fail")),
    "thread_exceptions": ("PEERWATCH_THREAD_EXCEPTIONS", _choice("record", "fail")),
    "hang_timeout": ("PEERWATCH_HANG_TIMEOUT", _hang("hang_timeout", "0")),
    "hang_warn": ("PEERWATCH_HANG_WARN", _hang("hang_warn", "off")),
    "gil_timeout": ("PEERWATCH_GIL_TIMEOUT", _off_or_duration("gil_timeout")),
    "stragglers": ("PEERWATCH_STRAGGLERS", _flag),
    "strict": ("PEERWATCH_STRICT", _flag),
    "use_pidfd": ("PEERWATCH_PIDFD", _flag),
    "verbose": ("PEERWATCH_VERBOSE", _flag),
    "store": ("PEERWATCH_STORE", _store),
    "run_id": ("PEERWATCH_RUN_ID", _run_id),
    "peer_timeout": ("PEERWATCH_PEER_TIMEOUT", _duration("peer_timeout")),
    "shared_fs": ("PEERWATCH_SHARED_FS", _shared_fs),
    "store_secret": ("PEERWATCH_STORE_SECRET", _secret),
    "store_secret_file": ("PEERWATCH_STORE_SECRET_FILE", _secret_file),
    "on_verdict": ("PEERWATCH_ON_VERDICT", _on_verdict),
    "on_verdict_timeout": ("PEERWATCH_ON_VERDICT_TIMEOUT", _duration("on_verdict_timeout")),
}
_OPTION_NAMES = frozenset(_OPTIONS)

# The other PEERWATCH_* variables peerwatch and its own tools read or set: never warned about.
_OTHER_VARS = frozenset({
    "PEERWATCH_DIR_OWNER",  # exported by install() with PEERWATCH_DIR, for the ranks it starts (basedir)
    "PEERWATCH_GC_KEEP", "PEERWATCH_GC_AGE",  # the policy of `peerwatch gc` and install()'s collection (gc)
    # Set for the on_verdict command (notify); a Python program it runs may call install().
    "PEERWATCH_REPORT", "PEERWATCH_FAILED_RANK", "PEERWATCH_CAUSE", "PEERWATCH_RUN_DIR", "PEERWATCH_HOST",
    "PEERWATCH_DOCTOR_ID",  # carried by every process of `peerwatch doctor`'s self-test
    "PEERWATCH_LOAD_ISOLATED",  # benchmarks/bridge_load.py, re-run in its own network namespace
    "PEERWATCH_FULL_MATRIX", "PEERWATCH_MATRIX_TIMES", "PEERWATCH_DOCS_TIMELINE",  # the test suite's knobs
})
_TEST_PREFIX = "PEERWATCH_TEST_"  # the test suite's own (PEERWATCH_TEST_ID, PEERWATCH_TEST_NO_INOTIFY...)
# What a user sets: a misspelt name is told the closest of these (not the hook's own).
_SETTABLE_VARS = frozenset(var for var, _ in _OPTIONS.values()) | {"PEERWATCH_GC_KEEP", "PEERWATCH_GC_AGE"}
KNOWN_VARS = _SETTABLE_VARS | _OTHER_VARS


def unknown_variables(env: Mapping[str, str]) -> List[Tuple[str, Optional[str]]]:
    """Each ``PEERWATCH_*`` variable of ``env`` that peerwatch does not read, with the known
    variable a user sets whose name is closest (None where none is close), sorted: a misspelt one
    (``PEERWATCH_HANG_TIMOUT``) would otherwise be ignored without a word."""
    prefix = "PEERWATCH_"
    # Compared without the prefix every name shares, or any name would be close to some.
    settable = {var[len(prefix):]: var for var in sorted(_SETTABLE_VARS)}
    found = []
    for name in sorted(env):
        if name.startswith(prefix) and name not in KNOWN_VARS and not name.startswith(_TEST_PREFIX):
            near = difflib.get_close_matches(name[len(prefix):], list(settable), n=1)
            found.append((name, settable[near[0]] if near else None))
    return found


def _given_values(options: Mapping[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each option the user gave, parsed: a keyword argument first, then its ``PEERWATCH_*`` variable."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, (env_var, parse) in _OPTIONS.items():
        if name in options and options[name] is not None:
            raw, source = options[name], "keyword argument"
        elif env.get(env_var, "") != "":
            raw, source = env[env_var], f"environment variable {env_var}"
        else:
            continue
        try:
            values[name] = parse(raw)
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigError(name, SECRET_SHOWN if name == "store_secret" else raw, source, str(e)) from None
        sources[name] = source
    return values, sources


def _fold_aliases(values: dict[str, Any], sources: dict[str, str], options: Mapping[str, Any],
                  env: Mapping[str, str]) -> None:
    """``disable`` becomes ``enabled``; ``store_secret_file`` becomes ``store_secret`` (not both)."""
    if "disable" in values:
        values["enabled"] = not values.pop("disable")
        sources["enabled"] = sources.pop("disable")
    if "store_secret_file" in values:
        if "store_secret" in values:
            raise ConfigError("store_secret_file", options.get("store_secret_file") or env.get("PEERWATCH_STORE_SECRET_FILE"),
                              sources["store_secret_file"],
                              f"store_secret is set too ({sources['store_secret']}): set one of them")
        values["store_secret"] = values.pop("store_secret_file")
        sources["store_secret"] = sources.pop("store_secret_file")


def _launcher_ranks(values: dict[str, Any], sources: dict[str, str], env: Mapping[str, str]) -> None:
    """Rank and sizes the user did not give, from the launchers' variables (RANK, LOCAL_RANK, ...)."""
    for name, var_names in (
        ("rank", _RANK_VARS),
        ("world_size", _WORLD_VARS),
        ("local_rank", _LOCAL_RANK_VARS),
        ("local_world_size", _LOCAL_WORLD_VARS),
    ):
        if name in values:
            continue
        for var in var_names:
            if env.get(var, "") != "":
                source = f"environment variable {var}"
                try:
                    values[name] = _non_negative_int(env[var])
                except ValueError as e:
                    raise ConfigError(name, env[var], source, str(e)) from None
                sources[name] = source
                break
    if "rank" not in values and "local_rank" in values and env.get("NODE_RANK", "0") == "0":
        # Lightning's subprocess launcher sets LOCAL_RANK and NODE_RANK, not RANK.
        values["rank"] = values["local_rank"]
        sources["rank"] = sources["local_rank"]


# -- launcher facts: beyond one host -------------------------------------------------------

_NODE_COUNT_VARS = ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "GROUP_WORLD_SIZE")  # hosts, as the launcher says
KEY_ROOT = "peerwatch"  # every store key of peerwatch lives under KEY_ROOT/<run_id>/


@dataclasses.dataclass(frozen=True)
class LauncherFacts:
    """What the launcher's environment says about the job beyond this host, resolved once
    (with the :class:`Config`) by :meth:`resolve`. Where the launcher sets
    ``MASTER_ADDR``/``MASTER_PORT`` only after ``install()`` (Lightning under Slurm), the
    store bridge resolves them again, into a new value, until ``store`` and ``run_id`` are known.
    """

    wants_store: bool = False  # a bridge is needed: the job spans hosts, or a store is set
    spans_hosts: bool = False
    store: Any = None  # "host:port", the user's Store object, or None (no bridge, or not known yet)
    store_why: str = ""  # where ``store`` came from, or why there is none
    run_id: Optional[str] = None  # names the job on every host; None: nothing does (yet)
    expected_hosts: Optional[int] = None  # how many hosts the job has, when the launcher says

    @classmethod
    def resolve(cls, config: Config, env: Mapping[str, str] | None = None) -> LauncherFacts:
        env = os.environ if env is None else env
        spans = spans_hosts(config, env)
        store, why = resolve_store(config, env)
        return cls(
            wants_store=config.store != "off" and (config.store is not None or spans), spans_hosts=spans,
            store=store, store_why=why, run_id=resolve_run_id(config, env), expected_hosts=expected_hosts(config, env),
        )

    @property
    def ready(self) -> bool:
        """Store and run id known: a bridge can start."""
        return self.store is not None and bool(self.run_id)

    @property
    def address(self) -> str:
        """The store, for messages: ``host:port`` or the Store object's type."""
        if self.store is None:
            return ""
        return self.store if isinstance(self.store, str) else type(self.store).__name__

    @property
    def key_prefix(self) -> str:
        return key_prefix(self.run_id) if self.run_id else ""


def spans_hosts(config: Config, env: Mapping[str, str]) -> bool:
    """Does the job run on more than one host, as far as the launcher says?"""
    if config.world_size and config.local_world_size and config.world_size > config.local_world_size:
        return True
    for var in _NODE_COUNT_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def expected_hosts(config: Config, env: Mapping[str, str]) -> Optional[int]:
    """How many hosts the job has, when the launcher says: a bridge stops looking for more."""
    w, lw = config.world_size, config.local_world_size
    if w and lw:
        return -(-w // lw)
    for var in _NODE_COUNT_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def resolve_store(config: Config, env: Mapping[str, str]) -> Tuple[Any, str]:
    """``(endpoint, why)``: endpoint is ``"host:port"``, a Store object, or None (no bridge)."""
    store = config.store
    if store == "off":
        return None, f"store=off ({config.source_of('store')})"
    if store is not None:
        return store, config.source_of("store")
    if not spans_hosts(config, env):
        return None, "the job runs on one host"
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None, "the job spans hosts but MASTER_ADDR/MASTER_PORT are not set (set PEERWATCH_STORE)"
    return f"{addr.strip('[]')}:{int(port)}", "MASTER_ADDR/MASTER_PORT (the job spans hosts)"


def resolve_run_id(config: Config, env: Mapping[str, str]) -> Optional[str]:
    """The job's name, the same on every host. A torchrun restart is a new run: the agent's
    store outlives it, so its keys must not be found by the next attempt."""
    if config.run_id:
        return config.run_id
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"master-{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def key_prefix(run_id: str) -> str:
    return f"{KEY_ROOT}/{run_id}/"

__all__ = [
    "GRACE_S", "KNOWN_VARS", "MAX_SECONDS", "Config", "HangSetting", "LauncherFacts", "expected_hosts", "key_prefix", "resolve_run_id", "resolve_store",
    "spans_hosts", "unknown_variables",
]
