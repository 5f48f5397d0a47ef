"""Config values that the table tests of test_config.py do not reach: the store secret (and
its file), on_verdict, the flags and enums, the maxima as the errors say them. The secret
file is a real file (tmp_path), so this module is not marked pure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from peerwatch import Config, ConfigError
from peerwatch.core.config import MAX_SECONDS, SECRET_MIN_BYTES, SECRET_SHOWN, HangSetting

SECRET = "s" * SECRET_MIN_BYTES


def resolve(env=None, **options) -> Config:
    return Config.resolve(options, env={} if env is None else env)


def refused(env=None, **options) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        resolve(env, **options)
    return info.value


# -- the store secret --------------------------------------------------------------------


def test_a_secret_of_the_minimum_length_is_taken_as_bytes_one_byte_less_is_refused():
    assert resolve(store_secret=SECRET).store_secret == SECRET.encode()
    assert resolve(store_secret=SECRET.encode()).store_secret == SECRET.encode()
    e = refused(store_secret=SECRET[1:])
    assert e.option == "store_secret" and f"at least {SECRET_MIN_BYTES} bytes" in str(e)
    assert SECRET[1:] not in str(e) and SECRET_SHOWN in str(e)  # never printed


def test_a_secret_that_is_neither_text_nor_bytes_is_refused():
    assert "expected a string or bytes" in str(refused(store_secret=12345678901234567890))


def _secret_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_secret_file_gives_its_secret_without_the_line_break(tmp_path: Path):
    path = _secret_file(tmp_path, SECRET.encode() + b"\n")
    c = resolve(env={"PEERWATCH_STORE_SECRET_FILE": str(path)})
    assert c.store_secret == SECRET.encode() and c.source_of("store_secret") == "environment variable PEERWATCH_STORE_SECRET_FILE"


def test_a_secret_file_and_a_secret_together_are_refused(tmp_path: Path):
    path = _secret_file(tmp_path, SECRET.encode())
    e = refused(env={"PEERWATCH_STORE_SECRET_FILE": str(path)}, store_secret=SECRET)
    assert e.option == "store_secret_file" and "store_secret is set too (keyword argument)" in str(e)
    assert str(path) in str(e)


@pytest.mark.parametrize(("mode", "ok"), [(0o600, True), (0o640, True), (0o604, False), (0o620, False), (0o602, False)])
def test_a_secret_file_others_may_read_or_change_is_refused(tmp_path: Path, mode: int, ok: bool):
    path = _secret_file(tmp_path, SECRET.encode(), mode)
    if ok:
        assert resolve(store_secret_file=str(path)).store_secret == SECRET.encode()
    else:
        assert f"has mode {mode:o}" in str(refused(store_secret_file=str(path)))


def test_a_secret_file_that_is_no_regular_file_or_missing_or_too_big_is_refused(tmp_path: Path):
    assert "is not a regular file" in str(refused(store_secret_file="/dev/null"))
    assert "cannot be read" in str(refused(store_secret_file=str(tmp_path / "none")))
    at_limit = _secret_file(tmp_path, b"k" * 4096)
    assert resolve(store_secret_file=str(at_limit)).store_secret == b"k" * 4096
    over = _secret_file(tmp_path, b"k" * 4097)
    assert "is over 4096 bytes" in str(refused(store_secret_file=str(over)))


def test_a_secret_file_holding_a_short_secret_says_so(tmp_path: Path):
    path = _secret_file(tmp_path, b"short\n")
    assert "holds a secret that must be at least" in str(refused(store_secret_file=str(path)))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_secret_file_of_another_user_is_refused(tmp_path: Path):
    path = _secret_file(tmp_path, SECRET.encode())
    os.chown(path, 12345, 12345)
    assert "belongs to uid 12345" in str(refused(store_secret_file=str(path)))


# -- on_verdict, flags and enums -----------------------------------------------------------


def test_on_verdict_takes_a_command_or_a_callable():
    def hook(verdict, report):  # noqa: ANN001, ANN202
        pass

    assert resolve(on_verdict=hook).on_verdict is hook
    assert resolve(env={"PEERWATCH_ON_VERDICT": "echo hi"}).on_verdict == "echo hi"
    assert "must not be empty" in str(refused(on_verdict="  "))
    assert "expected a shell command" in str(refused(on_verdict=3))


@pytest.mark.parametrize(("raw", "value"), [(True, True), (False, False), ("yes", True), ("off", False), (" ON ", True)])
def test_flags(raw, value):
    assert resolve(strict=raw).strict is value


def test_a_flag_that_is_no_flag_is_refused():
    assert "expected one of 1/0" in str(refused(strict="maybe"))


@pytest.mark.parametrize(("option", "good", "bad", "says"), [
    ("startup_action", "FAIL", "stop", "expected warn or fail"),
    ("thread_exceptions", " Record ", "ignore", "expected record or fail"),
    ("shared_fs", "Auto", "maybe", "expected auto, on or off"),
])
def test_enums_take_their_words_in_any_case_and_refuse_others(option, good, bad, says):
    assert getattr(resolve(**{option: good}), option) == good.strip().lower()
    assert says in str(refused(**{option: bad}))


@pytest.mark.parametrize(("raw", "value"), [("yes", "on"), ("0", "off"), ("auto", "auto")])
def test_shared_fs_takes_flags_too(raw, value):
    assert resolve(shared_fs=raw).shared_fs == value


@pytest.mark.parametrize(("option", "spoken"), [("grace", "a day"), ("ack_window", "an hour"),
                                                 ("hang_timeout", "a week")])
def test_a_duration_over_its_maximum_says_the_maximum_in_words(option, spoken):
    assert f"({spoken})" in str(refused(**{option: MAX_SECONDS[option] * 2}))


def test_hang_timeout_takes_auto_and_its_off_word():
    assert resolve(hang_timeout="0").hang_timeout == HangSetting()
    assert resolve(hang_warn=" OFF ").hang_warn == HangSetting()
    assert resolve(hang_timeout="12").hang_timeout == HangSetting(seconds=12.0)
