"""Config: keyword arguments > PEERWATCH_* environment > defaults, and errors that say where.

Every test passes its own ``env=`` mapping; os.environ is never read or changed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerwatch import Config, ConfigError
from peerwatch.core.config import (
    ACK_WINDOW_S,
    DEFAULT_EXIT_CODE,
    GRACE_S,
    HEARTBEAT_INTERVAL_S,
    MAX_SECONDS,
    PARENT_WAIT_S,
    HangSetting,
)

KW = "keyword argument"


def seconds_of(value: object) -> object:
    """A duration's seconds, whether Config keeps them as a number or in a HangSetting."""
    return value.seconds if isinstance(value, HangSetting) else value


pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks


def env_source(var: str) -> str:
    return f"environment variable {var}"


def resolve(env=None, **options) -> Config:
    return Config.resolve(options, env={} if env is None else env)


# -- defaults ------------------------------------------------------------------------------


def test_defaults_with_nothing_set():
    c = resolve()
    assert c == Config()
    assert (c.enabled, c.run_dir, c.rank, c.world_size, c.local_rank, c.local_world_size) == (
        True, None, None, None, None, None)
    assert (c.grace, c.ack_window, c.heartbeat_interval, c.parent_wait, c.exit_code) == (
        GRACE_S, ACK_WINDOW_S, HEARTBEAT_INTERVAL_S, PARENT_WAIT_S, DEFAULT_EXIT_CODE)
    assert c.effective_rank == 0
    assert c.sources == ()
    assert c.source_of("grace") == "default"


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve().grace = 1.0  # type: ignore[misc]


def test_unrelated_environment_is_ignored():
    assert resolve(env={"GRACE": "3", "peerwatch_grace": "3", "PEERWATCH_GRACEFUL": "3"}) == Config()


# -- each option from the environment ---------------------------------------------------------

OPTIONS = [
    # option, variable, raw text, parsed value
    ("run_dir", "PEERWATCH_DIR", "/some/where", "/some/where"),
    ("rank", "PEERWATCH_RANK", "3", 3),
    ("world_size", "PEERWATCH_WORLD_SIZE", "8", 8),
    ("local_rank", "PEERWATCH_LOCAL_RANK", "1", 1),
    ("local_world_size", "PEERWATCH_LOCAL_WORLD_SIZE", "4", 4),
    ("grace", "PEERWATCH_GRACE", "2.5", 2.5),
    ("ack_window", "PEERWATCH_ACK_WINDOW", "0.25", 0.25),
    ("heartbeat_interval", "PEERWATCH_HEARTBEAT", "3", 3.0),
    ("parent_wait", "PEERWATCH_PARENT_WAIT", "0", 0.0),
    ("exit_code", "PEERWATCH_EXIT_CODE", "42", 42),
    ("startup_timeout", "PEERWATCH_STARTUP_TIMEOUT", "60", 60.0),
    ("strict", "PEERWATCH_STRICT", "yes", True),
    ("use_pidfd", "PEERWATCH_PIDFD", "off", False),
    ("startup_action", "PEERWATCH_STARTUP_ACTION", " Fail ", "fail"),
    ("thread_exceptions", "PEERWATCH_THREAD_EXCEPTIONS", "FAIL", "fail"),
    ("hang_timeout", "PEERWATCH_HANG_TIMEOUT", "600", HangSetting(seconds=600.0)),
    ("gil_timeout", "PEERWATCH_GIL_TIMEOUT", "2", 2.0),
    ("store", "PEERWATCH_STORE", " node0:29500 ", "node0:29500"),
    ("run_id", "PEERWATCH_RUN_ID", " job-42 ", "job-42"),
    ("peer_timeout", "PEERWATCH_PEER_TIMEOUT", "60", 60.0),
    ("shared_fs", "PEERWATCH_SHARED_FS", "On", "on"),
]
# What each option is given as a keyword in test_keyword_beats_environment (default: 1).
KW_VALUES = {"run_dir": "/kw", "strict": False, "use_pidfd": True, "startup_action": "warn",
             "thread_exceptions": "record", "hang_timeout": 5.0, "gil_timeout": 5.0, "store": "off",
             "run_id": "kw-job", "peer_timeout": 45.0, "shared_fs": "off"}
KW_PARSED = {"hang_timeout": HangSetting(seconds=5.0)}  # where the value parsed is not the one given


@pytest.mark.parametrize(("option", "var", "raw", "value"), OPTIONS, ids=[o[0] for o in OPTIONS])
def test_each_option_from_its_environment_variable(option, var, raw, value):
    c = resolve(env={var: raw})
    assert getattr(c, option) == value
    assert c.source_of(option) == env_source(var)


@pytest.mark.parametrize(("option", "var", "raw", "value"), OPTIONS, ids=[o[0] for o in OPTIONS])
def test_keyword_beats_environment(option, var, raw, value):
    kw_value = KW_VALUES.get(option, 1)
    c = resolve(env={var: raw}, **{option: kw_value})
    assert getattr(c, option) == KW_PARSED.get(option, kw_value)
    assert c.source_of(option) == KW


def test_keyword_none_falls_back_to_environment():
    c = resolve(env={"PEERWATCH_GRACE": "2"}, grace=None)
    assert (c.grace, c.source_of("grace")) == (2.0, env_source("PEERWATCH_GRACE"))


def test_empty_environment_variable_means_unset():
    c = resolve(env={"PEERWATCH_GRACE": "", "RANK": "", "SLURM_PROCID": "2"})
    assert c.grace == GRACE_S and c.source_of("grace") == "default"
    assert (c.rank, c.source_of("rank")) == (2, env_source("SLURM_PROCID"))


def test_relative_run_dir_is_made_absolute():
    assert resolve(run_dir="rel/dir").run_dir == os.path.abspath("rel/dir")
    assert resolve(env={"PEERWATCH_DIR": "rel"}).run_dir == os.path.abspath("rel")


@pytest.mark.parametrize("text", ["1", "true", "TRUE", " yes ", "on"])
def test_disable_switches_peerwatch_off(text):
    c = resolve(env={"PEERWATCH_DISABLE": text})
    assert c.enabled is False
    assert c.source_of("enabled") == env_source("PEERWATCH_DISABLE")


@pytest.mark.parametrize("text", ["0", "false", "no", "off"])
def test_disable_false_leaves_peerwatch_on(text):
    assert resolve(env={"PEERWATCH_DISABLE": text}).enabled is True


def test_disable_keyword():
    assert resolve(disable=True).enabled is False
    assert resolve(env={"PEERWATCH_DISABLE": "1"}, disable=False).enabled is True


@settings(deadline=None)
@given(st.floats(min_value=0, max_value=MAX_SECONDS["grace"], allow_nan=False, allow_infinity=False))
def test_any_finite_non_negative_seconds_up_to_the_maximum_are_accepted(seconds):
    assert resolve(env={"PEERWATCH_GRACE": repr(seconds)}).grace == seconds
    assert resolve(grace=seconds).grace == seconds


# -- rank and world size from the launcher's variables -----------------------------------------


@pytest.mark.parametrize(
    ("env", "rank", "world", "rank_var"),
    [
        ({"RANK": "3", "WORLD_SIZE": "8"}, 3, 8, "RANK"),  # torchrun
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6"}, 5, 6, "SLURM_PROCID"),  # srun
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, 1, 2, "OMPI_COMM_WORLD_RANK"),
        ({"PMI_RANK": "0", "PMI_SIZE": "4"}, 0, 4, "PMI_RANK"),
        ({"RANK": "2", "SLURM_PROCID": "7", "WORLD_SIZE": "4", "SLURM_NTASKS": "16"}, 2, 4, "RANK"),
        ({"PEERWATCH_RANK": "1", "RANK": "2", "WORLD_SIZE": "4"}, 1, 4, "PEERWATCH_RANK"),
    ],
    ids=["torchrun", "slurm", "openmpi", "pmi", "RANK-beats-SLURM", "PEERWATCH_RANK-beats-RANK"],
)
def test_rank_and_world_size_from_launcher_variables(env, rank, world, rank_var):
    c = resolve(env=env)
    assert (c.rank, c.world_size, c.effective_rank) == (rank, world, rank)
    assert c.source_of("rank") == env_source(rank_var)


def test_rank_keyword_beats_launcher_variables():
    c = resolve(env={"RANK": "2", "WORLD_SIZE": "4"}, rank=1)
    assert (c.rank, c.source_of("rank"), c.world_size) == (1, KW, 4)


def test_local_rank_and_local_world_size():
    c = resolve(env={"RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"})
    assert (c.rank, c.local_rank, c.local_world_size) == (5, 1, 4)
    c = resolve(env={"SLURM_PROCID": "5", "SLURM_LOCALID": "2"})
    assert (c.rank, c.local_rank) == (5, 2)


@pytest.mark.parametrize("node_rank", [{"NODE_RANK": "0"}, {}], ids=["NODE_RANK=0", "no NODE_RANK"])
def test_lightning_child_takes_its_rank_from_local_rank(node_rank):
    # Lightning's subprocess launcher sets LOCAL_RANK, NODE_RANK and WORLD_SIZE, not RANK.
    c = resolve(env={"LOCAL_RANK": "2", "WORLD_SIZE": "4", **node_rank})
    assert (c.rank, c.local_rank, c.world_size, c.effective_rank) == (2, 2, 4, 2)
    assert c.source_of("rank") == env_source("LOCAL_RANK")


def test_local_rank_on_another_node_is_not_the_rank():
    c = resolve(env={"LOCAL_RANK": "2", "NODE_RANK": "1"})
    assert (c.rank, c.local_rank) == (None, 2)


def test_lightning_parent_before_it_spawns_has_no_rank():
    c = resolve(env={"MASTER_ADDR": "127.0.0.1"})
    assert (c.rank, c.effective_rank) == (None, 0)


def test_local_rank_keyword_does_not_override_rank_from_environment():
    c = resolve(env={"RANK": "6", "WORLD_SIZE": "8"}, local_rank=2)
    assert (c.rank, c.local_rank) == (6, 2)


# -- errors name the option, the value and its source --------------------------------------------

BAD = [
    # env or kwargs, option, value, source
    ({"PEERWATCH_GRACE": "-1"}, {}, "grace", "-1", env_source("PEERWATCH_GRACE")),
    ({"PEERWATCH_GRACE": "nan"}, {}, "grace", "nan", env_source("PEERWATCH_GRACE")),
    ({"PEERWATCH_GRACE": "inf"}, {}, "grace", "inf", env_source("PEERWATCH_GRACE")),
    ({"PEERWATCH_GRACE": "five"}, {}, "grace", "five", env_source("PEERWATCH_GRACE")),
    ({"PEERWATCH_GRACE": "1e400"}, {}, "grace", "1e400", env_source("PEERWATCH_GRACE")),
    ({}, {"grace": -0.5}, "grace", -0.5, KW),
    ({}, {"grace": math.nan}, "grace", math.nan, KW),
    ({}, {"grace": math.inf}, "grace", math.inf, KW),
    ({}, {"grace": "soon"}, "grace", "soon", KW),
    ({}, {"grace": True}, "grace", True, KW),
    ({"PEERWATCH_ACK_WINDOW": "-inf"}, {}, "ack_window", "-inf", env_source("PEERWATCH_ACK_WINDOW")),
    ({"PEERWATCH_HEARTBEAT": "1s"}, {}, "heartbeat_interval", "1s", env_source("PEERWATCH_HEARTBEAT")),
    ({"PEERWATCH_PARENT_WAIT": "-0.1"}, {}, "parent_wait", "-0.1", env_source("PEERWATCH_PARENT_WAIT")),
    ({"PEERWATCH_STARTUP_TIMEOUT": "NaN"}, {}, "startup_timeout", "NaN",
     env_source("PEERWATCH_STARTUP_TIMEOUT")),
    ({"PEERWATCH_EXIT_CODE": "0"}, {}, "exit_code", "0", env_source("PEERWATCH_EXIT_CODE")),
    ({"PEERWATCH_EXIT_CODE": "256"}, {}, "exit_code", "256", env_source("PEERWATCH_EXIT_CODE")),
    ({"PEERWATCH_EXIT_CODE": "-1"}, {}, "exit_code", "-1", env_source("PEERWATCH_EXIT_CODE")),
    ({}, {"exit_code": 1.5}, "exit_code", 1.5, KW),
    ({"PEERWATCH_RANK": "-1"}, {}, "rank", "-1", env_source("PEERWATCH_RANK")),
    ({"PEERWATCH_RANK": "one"}, {}, "rank", "one", env_source("PEERWATCH_RANK")),
    ({"PEERWATCH_RANK": "1.0"}, {}, "rank", "1.0", env_source("PEERWATCH_RANK")),
    ({}, {"rank": 1.5}, "rank", 1.5, KW),
    ({}, {"rank": True}, "rank", True, KW),
    ({}, {"rank": math.nan}, "rank", math.nan, KW),
    ({}, {"rank": -2}, "rank", -2, KW),
    ({"RANK": "abc"}, {}, "rank", "abc", env_source("RANK")),
    ({"RANK": "-3"}, {}, "rank", "-3", env_source("RANK")),
    ({"SLURM_PROCID": "x"}, {}, "rank", "x", env_source("SLURM_PROCID")),
    ({"WORLD_SIZE": "many"}, {}, "world_size", "many", env_source("WORLD_SIZE")),
    ({"LOCAL_RANK": "-1"}, {}, "local_rank", "-1", env_source("LOCAL_RANK")),
    ({"PEERWATCH_STRICT": "maybe"}, {}, "strict", "maybe", env_source("PEERWATCH_STRICT")),
    ({}, {"use_pidfd": "2"}, "use_pidfd", "2", KW),
    ({"PEERWATCH_DISABLE": "please"}, {}, "disable", "please", env_source("PEERWATCH_DISABLE")),
    ({}, {"run_dir": ""}, "run_dir", "", KW),
    ({}, {"run_dir": 5}, "run_dir", 5, KW),
]


@pytest.mark.parametrize(("env", "kwargs", "option", "value", "source"), BAD,
                         ids=[f"{o}={v!r}({'env' if e else 'kw'})" for e, k, o, v, s in BAD])
def test_bad_value_names_option_value_and_source(env, kwargs, option, value, source):
    with pytest.raises(ConfigError) as info:
        Config.resolve(kwargs, env=env)
    e = info.value
    assert e.option == option
    assert e.value == value or (isinstance(value, float) and math.isnan(value) and math.isnan(e.value))
    assert e.source == source
    assert e.reason
    text = str(e)
    assert option in text and repr(value) in text and source in text


@pytest.mark.parametrize("options", [{"rank": math.inf}, {"exit_code": math.inf}, {"world_size": -math.inf},
                                     {"grace": 10**400}],
                         ids=["rank=inf", "exit_code=inf", "world_size=-inf", "grace=10**400"])
def test_overflowing_keyword_value_is_a_config_error(options):
    with pytest.raises(ConfigError) as info:
        Config.resolve(options, env={})
    assert info.value.option == next(iter(options)) and info.value.source == KW


def test_unknown_keyword_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        Config.resolve({"gracee": 3, "zzz": 1}, env={})
    assert (info.value.option, info.value.value, info.value.source) == ("gracee", 3, KW)
    assert "unknown option" in str(info.value)


def test_enabled_is_not_an_option():
    with pytest.raises(ConfigError):
        Config.resolve({"enabled": False}, env={})


@pytest.mark.parametrize(
    ("env", "kwargs", "source"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, {}, env_source("RANK")),
        ({"WORLD_SIZE": "2"}, {"rank": 2}, KW),
        ({"SLURM_PROCID": "9", "SLURM_NTASKS": "3"}, {}, env_source("SLURM_PROCID")),
        ({"LOCAL_RANK": "3", "WORLD_SIZE": "2"}, {}, env_source("LOCAL_RANK")),
    ],
)
def test_rank_at_or_above_world_size_is_a_config_error(env, kwargs, source):
    with pytest.raises(ConfigError) as info:
        Config.resolve(kwargs, env=env)
    e = info.value
    assert (e.option, e.source) == ("rank", source)
    assert "world_size" in str(e)


def test_world_size_zero_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        Config.resolve({}, env={"WORLD_SIZE": "0"})
    assert (info.value.option, info.value.value, info.value.source) == ("world_size", 0, env_source("WORLD_SIZE"))


def test_config_error_is_a_value_error_and_pickles():
    with pytest.raises(ValueError) as info:
        Config.resolve({}, env={"PEERWATCH_GRACE": "-1"})
    e = info.value
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is ConfigError
    assert (back.option, back.value, back.source, back.reason) == (e.option, e.value, e.source, e.reason)
    assert str(back) == str(e)



def test_defaults_are_the_documented_ones():
    # docs/configuration.md, "every option": the values users are told they get.
    c = resolve()
    assert (c.grace, c.ack_window, c.heartbeat_interval, c.parent_wait, c.exit_code) == (5.0, 0.5, 1.0, 0.1, 1)
    assert (c.startup_timeout, c.startup_action, c.thread_exceptions) == (None, "warn", "record")  # None: off
    assert (c.hang_timeout, c.gil_timeout, c.peer_timeout) == (HangSetting(), None, 30.0)
    assert (c.strict, c.use_pidfd, c.store, c.run_id, c.shared_fs) == (False, True, None, None, "auto")


def test_without_env_the_process_environment_is_read(monkeypatch):
    monkeypatch.setenv("PEERWATCH_GRACE", "7")
    c = Config.resolve({})
    assert (c.grace, c.source_of("grace")) == (7.0, env_source("PEERWATCH_GRACE"))


# -- the value parsers: what each accepts, and how it says no ------------------------------------


@pytest.mark.parametrize(("option", "raw", "value"), [
    ("exit_code", "1", 1), ("exit_code", "255", 255), ("exit_code", 3.0, 3),
    ("rank", "0", 0), ("rank", 2.0, 2), ("world_size", "1", 1),
    ("grace", "0", 0.0), ("grace", "0.5", 0.5), ("grace", 1, 1.0),
    ("startup_action", "warn", "warn"), ("startup_action", "FAIL", "fail"),
    ("thread_exceptions", " record ", "record"), ("thread_exceptions", "Fail", "fail"),
    ("shared_fs", " AUTO ", "auto"), ("shared_fs", "yes", "on"), ("shared_fs", "1", "on"),
    ("shared_fs", "no", "off"), ("shared_fs", "0", "off"), ("shared_fs", True, "on"),
    ("strict", "On", True), ("strict", "0", False), ("use_pidfd", False, False), ("use_pidfd", 1, True),
    ("store", "off", "off"), ("store", " NONE ", "off"), ("store", "0", "off"), ("store", "no", "off"),
    ("store", "false", "off"), ("store", "node0:1", "node0:1"), ("store", "node0:65535", "node0:65535"),
    ("store", "node0:029500", "node0:29500"), ("store", "[::1]:29500", "::1:29500"),
    ("store", "10.0.0.1:29500", "10.0.0.1:29500"),
    ("run_id", "x", "x"), ("run_id", "r" * 200, "r" * 200), ("run_id", 1234, "1234"),
])
def test_accepted_values(option, raw, value):
    c = resolve(**{option: raw})
    assert getattr(c, option) == value
    assert c.source_of(option) == KW


def test_a_store_object_is_kept_as_is():
    class Store:
        def set(self, key, value): ...
        def get(self, key): ...
        def compare_set(self, key, expected, desired): ...

    store = Store()
    assert resolve(store=store).store is store


MORE_BAD = [
    # option, raw, what the message says
    ("exit_code", "0", "must be an exit status from 1 to 255"),
    ("exit_code", 256, "must be an exit status from 1 to 255"),
    ("exit_code", True, "expected a whole number, got a boolean"),
    ("rank", "-1", "must not be negative"),
    ("rank", 2.5, "expected a whole number"),
    ("grace", "-0.001", "must be a finite number of seconds, 0 or more"),
    ("grace", False, "expected a number of seconds, got a boolean"),
    ("strict", "2", "expected one of 1/0, true/false, yes/no, on/off"),
    ("startup_action", "abort", "expected warn or fail"),
    ("startup_action", "", "expected warn or fail"),
    ("thread_exceptions", "raise", "expected record or fail"),
    ("shared_fs", "nfs", "expected auto, on or off"),
    ("store", "node0", "expected 'host:port' (e.g. node0:29500) or 'off'"),
    ("store", ":29500", "expected 'host:port' (e.g. node0:29500) or 'off'"),
    ("store", "node0:", "expected 'host:port' (e.g. node0:29500) or 'off'"),
    ("store", "node0:http", "expected 'host:port' (e.g. node0:29500) or 'off'"),
    ("store", "node0:0", "expected 'host:port' (e.g. node0:29500) or 'off'"),
    ("store", "node0:65536", "expected 'host:port' (e.g. node0:29500) or 'off'"),
    ("store", 29500, "expected 'host:port', 'off', or a torch.distributed Store"),
    ("store", object(), "expected 'host:port', 'off', or a torch.distributed Store"),
    ("run_id", "   ", "must be 1 to 200 characters"),
    ("run_id", "r" * 201, "must be 1 to 200 characters"),
    ("run_dir", "", "must not be empty"),
]


@pytest.mark.parametrize(("option", "raw", "reason"), MORE_BAD, ids=[f"{o}={r!r:.20}" for o, r, _ in MORE_BAD])
def test_bad_values_are_refused_saying_why_and_where_they_came_from(option, raw, reason):
    with pytest.raises(ConfigError) as info:
        resolve(**{option: raw})
    assert (info.value.option, info.value.value, info.value.source, info.value.reason) == (option, raw, KW, reason)
    if isinstance(raw, str) and option != "run_dir":
        var = dict((o, v) for o, v, *_ in OPTIONS).get(option) or {"exit_code": "PEERWATCH_EXIT_CODE"}.get(option)
        if var and raw.strip():
            with pytest.raises(ConfigError) as info:
                resolve(env={var: raw})
            assert (info.value.option, info.value.source, info.value.reason) == (option, env_source(var), reason)


def test_a_bad_launcher_variable_names_the_option_and_the_variable():
    with pytest.raises(ConfigError) as info:
        resolve(env={"OMPI_COMM_WORLD_LOCAL_RANK": "-1"})
    assert (info.value.option, info.value.value, info.value.source, info.value.reason) == (
        "local_rank", "-1", env_source("OMPI_COMM_WORLD_LOCAL_RANK"), "must not be negative")


# -- the rules between options (checked once every value is known) ------------------------------


def test_heartbeat_interval_must_be_above_zero():
    with pytest.raises(ConfigError) as info:
        resolve(env={"PEERWATCH_HEARTBEAT": "0"})
    e = info.value
    assert (e.option, e.value, e.source, e.reason) == (
        "heartbeat_interval", 0.0, env_source("PEERWATCH_HEARTBEAT"), "must be above 0")
    assert resolve(heartbeat_interval=0.01).heartbeat_interval == 0.01


@pytest.mark.parametrize("option", ["hang_timeout", "gil_timeout"])
def test_a_timeout_judged_by_heartbeats_is_off_or_at_least_two_of_them(option):
    var = {"hang_timeout": "PEERWATCH_HANG_TIMEOUT", "gil_timeout": "PEERWATCH_GIL_TIMEOUT"}[option]
    assert seconds_of(getattr(resolve(env={var: "0"}), option)) is None  # off
    assert seconds_of(getattr(resolve(env={var: "2", "PEERWATCH_HEARTBEAT": "1"}), option)) == 2.0
    assert seconds_of(getattr(resolve(env={var: "1"}, heartbeat_interval=0.5), option)) == 1.0
    with pytest.raises(ConfigError) as info:
        resolve(env={var: "1.9"})
    e = info.value
    assert (e.option, e.value, e.source) == (option, 1.9, env_source(var))
    assert e.reason == "must be 0 (off) or at least twice heartbeat_interval (1s)"
    with pytest.raises(ConfigError) as info:
        resolve(env={var: "5"}, heartbeat_interval=2.5001)
    assert (info.value.option, info.value.source) == (option, env_source(var))
    assert info.value.reason == "must be 0 (off) or at least twice heartbeat_interval (2.5001s)"


def test_peer_timeout_is_at_least_two_heartbeats():
    assert resolve(peer_timeout=2.0).peer_timeout == 2.0
    assert resolve(peer_timeout=10.0, heartbeat_interval=5.0).peer_timeout == 10.0
    with pytest.raises(ConfigError) as info:
        resolve(peer_timeout=1.5)
    e = info.value
    assert (e.option, e.value, e.source) == ("peer_timeout", 1.5, KW)
    assert e.reason == "must be at least twice heartbeat_interval (1s)"
    # The default peer_timeout (30 s) follows a slow heartbeat: twice its interval.
    assert resolve(env={"PEERWATCH_HEARTBEAT": "20"}).peer_timeout == 40.0


@pytest.mark.parametrize("env", [{"RANK": "7"}, {"WORLD_SIZE": "2"}, {}], ids=["rank only", "world only", "none"])
def test_rank_and_world_size_are_compared_only_when_both_are_known(env):
    c = resolve(env=env)
    assert (c.rank, c.world_size) == (int(env["RANK"]) if "RANK" in env else None,
                                      int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else None)


def test_rank_at_or_above_world_size_says_where_both_came_from():
    with pytest.raises(ConfigError) as info:
        Config.resolve({"world_size": 3}, env={"RANK": "3"})
    e = info.value
    assert (e.option, e.value, e.source) == ("rank", 3, env_source("RANK"))
    assert e.reason == "rank must be below world_size=3 (keyword argument)"
    assert resolve(env={"RANK": "2"}, world_size=3).rank == 2


def test_world_size_zero_is_refused_with_its_reason():
    with pytest.raises(ConfigError) as info:
        resolve(world_size=0)
    assert (info.value.option, info.value.value, info.value.source, info.value.reason) == (
        "world_size", 0, KW, "must be at least 1")


# -- the largest durations (issue 14: absurd finite values passed, then killed the watcher) ---------

_DURATION_VARS = {
    "grace": "PEERWATCH_GRACE", "ack_window": "PEERWATCH_ACK_WINDOW", "heartbeat_interval": "PEERWATCH_HEARTBEAT",
    "parent_wait": "PEERWATCH_PARENT_WAIT", "startup_timeout": "PEERWATCH_STARTUP_TIMEOUT",
    "hang_timeout": "PEERWATCH_HANG_TIMEOUT", "gil_timeout": "PEERWATCH_GIL_TIMEOUT",
    "peer_timeout": "PEERWATCH_PEER_TIMEOUT", "hang_warn": "PEERWATCH_HANG_WARN",
    "on_verdict_timeout": "PEERWATCH_ON_VERDICT_TIMEOUT",
}


def test_every_duration_has_a_maximum():
    assert set(MAX_SECONDS) == set(_DURATION_VARS)
    # All together, the longest waits still fit poll(2)'s milliseconds and threading's timeouts.
    longest = MAX_SECONDS["hang_timeout"] + 4 * MAX_SECONDS["heartbeat_interval"] + MAX_SECONDS["grace"] \
        + MAX_SECONDS["ack_window"] + MAX_SECONDS["parent_wait"] + MAX_SECONDS["on_verdict_timeout"]
    assert longest * 1000 < 2**31 - 1 and longest < threading.TIMEOUT_MAX


@pytest.mark.parametrize(("var", "raw"), [
    ("PEERWATCH_GRACE", "3e9"), ("PEERWATCH_GIL_TIMEOUT", "9e9"), ("PEERWATCH_HEARTBEAT", "2e6"),
    ("PEERWATCH_ACK_WINDOW", "2e6"), ("PEERWATCH_HANG_TIMEOUT", "1e300"), ("PEERWATCH_PEER_TIMEOUT", "1e12"),
    ("PEERWATCH_STARTUP_TIMEOUT", "1e10"), ("PEERWATCH_PARENT_WAIT", "1e7"),
])
def test_absurd_finite_durations_are_refused_saying_the_maximum(var, raw):
    option = next(o for o, v in _DURATION_VARS.items() if v == var)
    with pytest.raises(ConfigError) as info:
        Config.resolve({}, env={var: raw})
    e = info.value
    assert e.option == option and e.source == f"environment variable {var}"
    assert f"at most {MAX_SECONDS[option]:g}s" in str(e) and "poll(2)" in str(e)


@pytest.mark.parametrize("option", sorted(_DURATION_VARS))
def test_each_duration_is_accepted_up_to_its_maximum_and_refused_above(option):
    limit = MAX_SECONDS[option]
    others = {"peer_timeout": MAX_SECONDS["peer_timeout"]} if option == "heartbeat_interval" else {}
    assert seconds_of(getattr(Config.resolve({option: limit, **others}, env={}), option)) == limit
    with pytest.raises(ConfigError) as info:
        Config.resolve({option: math.nextafter(limit, math.inf) if hasattr(math, "nextafter") else limit * 1.000001},
                       env={})
    assert info.value.option == option and info.value.source == KW


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "-inf"])
def test_nan_inf_and_negative_durations_are_still_refused(raw):
    for option, var in _DURATION_VARS.items():
        with pytest.raises(ConfigError) as info:
            Config.resolve({}, env={var: raw})
        assert info.value.option == option


def test_the_longest_heartbeat_is_accepted_with_the_default_peer_timeout():
    """heartbeat_interval=3600, the documented maximum: the default peer_timeout (30 s)
    follows it (twice the interval), instead of refusing it. A peer_timeout the user set
    too short is still refused."""
    c = Config.resolve({"heartbeat_interval": 3600}, {})
    assert c.peer_timeout == 7200 and c.heartbeat_interval == 3600
    assert "twice heartbeat_interval" in c.source_of("peer_timeout")
    assert Config.resolve({"heartbeat_interval": 5}, {}).peer_timeout == 30  # the default, when it is enough
    with pytest.raises(ConfigError, match="peer_timeout"):
        Config.resolve({"heartbeat_interval": 3600, "peer_timeout": 30}, {})


# -- hang_timeout / hang_warn: off, auto or seconds (issue 25.4) ---------------------------


def test_hang_setting_is_off_auto_or_seconds():
    off, auto, secs = HangSetting(), HangSetting(auto=True), HangSetting(seconds=12.5)
    assert (off.on, off.auto, off.seconds) == (False, False, None)
    assert (auto.on, auto.auto, auto.seconds) == (True, True, None)
    assert (secs.on, secs.auto, secs.seconds) == (True, False, 12.5)


@pytest.mark.parametrize(("raw", "auto", "seconds"), [("auto", True, None), ("off", False, None), ("0", False, None),
                                                      ("12", False, 12.0)])
def test_config_parses_its_hang_settings_once(raw: str, auto: bool, seconds: object):
    timeout_raw = "0" if raw == "off" else raw  # hang_timeout's word for off is 0 (docs/configuration.md)
    c = Config.resolve({}, env={"PEERWATCH_HANG_TIMEOUT": timeout_raw, "PEERWATCH_HANG_WARN": raw})
    assert c.hang_timeout == c.hang_warn == HangSetting(auto=auto, seconds=seconds)
    d = Config.resolve({}, env={})
    assert d.hang_warn == HangSetting(auto=True) and not d.hang_timeout.on


@pytest.mark.parametrize("option", ["startup_timeout", "gil_timeout"])
@pytest.mark.parametrize(("raw", "seconds"), [(0, None), ("0", None), (" 0.0 ", None), ("60", 60.0), (90, 90.0)])
def test_a_timeout_of_0_is_off(option: str, raw: object, seconds: object):
    assert getattr(Config.resolve({option: raw}, env={}), option) == seconds


def test_hang_timeout_auto_is_not_checked_against_the_heartbeat():
    assert Config.resolve({"hang_timeout": "auto", "heartbeat_interval": 30}, env={}).hang_timeout.auto
    with pytest.raises(ConfigError, match="hang_timeout"):
        Config.resolve({"hang_timeout": 10, "heartbeat_interval": 30}, env={})


# -- exact values and edges (issue 25.6: what a mutant of core/config.py changes, a test sees) --


def test_a_hang_setting_below_one_second_is_a_setting_not_off():
    half = resolve(hang_warn=0.5).hang_warn
    assert (half.on, half.auto, half.seconds) == (True, False, 0.5)
    assert resolve(hang_warn=0.0).hang_warn == resolve(hang_warn="0").hang_warn == HangSetting()


def test_the_other_documented_defaults():
    # docs/configuration.md: on_verdict_timeout 10 s, hang_warn auto.
    c = resolve()
    assert (c.on_verdict_timeout, c.hang_warn) == (10.0, HangSetting(auto=True))
    assert resolve(hang_timeout="auto").hang_timeout == HangSetting(auto=True)


def test_the_maxima_are_the_documented_ones():
    # docs/configuration.md, "largest values".
    day, hour, week = 86400.0, 3600.0, 604800.0
    assert MAX_SECONDS == {
        "grace": day, "ack_window": hour, "heartbeat_interval": hour, "parent_wait": hour, "on_verdict_timeout": hour,
        "startup_timeout": week, "hang_timeout": week, "hang_warn": week, "gil_timeout": week, "peer_timeout": week,
    }


@pytest.mark.parametrize(("option", "said"), [
    ("grace", "at most 86400s (a day)"), ("ack_window", "at most 3600s (an hour)"),
    ("gil_timeout", "at most 604800s (a week)"),
])
def test_a_duration_over_its_maximum_says_it_in_words(option, said):
    with pytest.raises(ConfigError) as info:
        resolve(**{option: 1e9})
    assert said + ": the watcher's waits are poll(2) timeouts" in str(info.value)


def test_a_maximum_is_spoken_in_words_where_it_is_a_round_unit():
    from peerwatch.core.config import _spoken

    assert [_spoken(s) for s in (60.0, 3600.0, 86400.0, 604800.0, 90.0)] == [
        "a minute", "an hour", "a day", "a week", "90 seconds"]


@pytest.mark.parametrize(("beat", "peer_timeout", "source"), [
    (12.0, 30.0, "default"), (15.0, 30.0, "default"), (15.5, 31.0, "default: twice heartbeat_interval"),
])
def test_the_default_peer_timeout_follows_a_heartbeat_only_above_half_of_it(beat, peer_timeout, source):
    c = resolve(heartbeat_interval=beat)
    assert (c.peer_timeout, c.source_of("peer_timeout")) == (peer_timeout, source)


def test_on_verdict_timeout_must_be_above_0():
    assert resolve(on_verdict_timeout=0.5).on_verdict_timeout == 0.5
    with pytest.raises(ConfigError) as info:
        resolve(env={"PEERWATCH_ON_VERDICT_TIMEOUT": "0"})
    e = info.value
    assert (e.option, e.value, e.source) == ("on_verdict_timeout", 0.0, env_source("PEERWATCH_ON_VERDICT_TIMEOUT"))
    assert str(e) == ("peerwatch option on_verdict_timeout=0.0 (from environment variable "
                      "PEERWATCH_ON_VERDICT_TIMEOUT): must be above 0 (the hook's bound)")


# -- store_secret, store_secret_file (exact texts; tests/test_store_secret.py is the store's side) --

SECRET16 = "0123456789abcdef"  # the shortest secret taken


def test_a_secret_of_16_bytes_is_taken_as_bytes_and_15_are_refused_without_showing_them():
    assert resolve(store_secret=SECRET16).store_secret == SECRET16.encode()
    assert resolve(store_secret=SECRET16.encode()).store_secret == SECRET16.encode()
    with pytest.raises(ConfigError) as info:
        resolve(store_secret=SECRET16[:15])
    assert (info.value.option, info.value.value, info.value.reason) == (
        "store_secret", "<hidden>", "must be at least 16 bytes (e.g. `openssl rand -hex 32`)")
    with pytest.raises(ConfigError) as info:
        resolve(store_secret=1234567890123456789)
    assert info.value.reason == "expected a string or bytes"


def secret_file(tmp_path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def test_a_secret_file_is_read_without_its_line_break_up_to_4096_bytes(tmp_path):
    c = resolve(env={"PEERWATCH_STORE_SECRET_FILE": secret_file(tmp_path, SECRET16.encode() + b"\r\n")})
    assert c.store_secret == SECRET16.encode()
    assert c.source_of("store_secret") == env_source("PEERWATCH_STORE_SECRET_FILE")
    assert resolve(store_secret_file=secret_file(tmp_path, b"x" * 4096)).store_secret == b"x" * 4096
    assert resolve(store_secret_file=secret_file(tmp_path, SECRET16.encode(), 0o640)).store_secret  # group may read


@pytest.mark.parametrize(("content", "mode", "reason"), [
    (b"x" * 4097, 0o600, "is over 4096 bytes: not a secret file"),
    (b"short\n", 0o600, "holds a secret that must be at least 16 bytes (e.g. `openssl rand -hex 32`)"),
    (SECRET16.encode(), 0o604, "has mode 604: others may read or change it (chmod 600)"),
    (SECRET16.encode(), 0o602, "has mode 602: others may read or change it (chmod 600)"),
    (SECRET16.encode(), 0o620, "has mode 620: others may read or change it (chmod 600)"),
])
def test_a_secret_file_says_why_it_is_refused(tmp_path, content, mode, reason):
    path = secret_file(tmp_path, content, mode)
    with pytest.raises(ConfigError) as info:
        resolve(store_secret_file=path)
    assert (info.value.option, info.value.value, info.value.source, info.value.reason) == (
        "store_secret_file", path, KW, reason)


def test_a_secret_file_that_is_no_regular_file_or_missing_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve(store_secret_file=os.devnull)
    assert info.value.reason == "is not a regular file"
    with pytest.raises(ConfigError) as info:
        resolve(store_secret_file=str(tmp_path / "nope"))
    assert info.value.reason == "cannot be read (No such file or directory)"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root can give a file away")
@pytest.mark.parametrize("uid", [1, 4321])
def test_a_secret_file_of_another_user_is_refused(tmp_path, uid):
    path = secret_file(tmp_path, SECRET16.encode())
    os.chown(path, uid, -1)
    with pytest.raises(ConfigError) as info:
        resolve(store_secret_file=path)
    assert info.value.reason == f"belongs to uid {uid}, not to this user"


def test_a_secret_and_a_secret_file_together_are_refused(tmp_path):
    path = secret_file(tmp_path, SECRET16.encode())
    with pytest.raises(ConfigError) as info:
        resolve(env={"PEERWATCH_STORE_SECRET_FILE": path, "PEERWATCH_STORE_SECRET": SECRET16})
    e = info.value
    assert (e.option, e.value, e.source) == ("store_secret_file", path, env_source("PEERWATCH_STORE_SECRET_FILE"))
    assert e.reason == "store_secret is set too (environment variable PEERWATCH_STORE_SECRET): set one of them"
    with pytest.raises(ConfigError) as info:
        resolve(store_secret_file=path, store_secret=SECRET16)
    assert (info.value.value, info.value.source) == (path, KW)


@pytest.mark.parametrize("raw", ["inf", "nan", "-0.5"])
def test_a_duration_that_is_no_finite_count_of_seconds_says_so(raw):
    with pytest.raises(ConfigError) as info:
        resolve(env={"PEERWATCH_GRACE": raw})
    assert info.value.reason == "must be a finite number of seconds, 0 or more"


def test_on_verdict_is_a_command_or_a_callable():
    def hook(verdict, report_path):  # pragma: no cover - never called here
        pass

    assert resolve(on_verdict=hook).on_verdict is hook
    c = resolve(env={"PEERWATCH_ON_VERDICT": "notify-send failed"})
    assert (c.on_verdict, c.source_of("on_verdict")) == ("notify-send failed", env_source("PEERWATCH_ON_VERDICT"))
    assert resolve().on_verdict is None
    for raw, reason in ((" \t", "must not be empty"),
                        (5, "expected a shell command (a string) or a callable f(verdict, report_path)")):
        with pytest.raises(ConfigError) as info:
            resolve(on_verdict=raw)
        assert (info.value.option, info.value.value, info.value.reason) == ("on_verdict", raw, reason)
