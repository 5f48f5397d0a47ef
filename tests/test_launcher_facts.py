"""What the launcher says about the job beyond this host (``LauncherFacts`` in
``peerwatch/core/config.py``): resolved once, with the configuration. Pure and fast."""

from __future__ import annotations

import pytest

from peerwatch.core.config import (
    Config,
    LauncherFacts,
    expected_hosts,
    key_prefix,
    resolve_run_id,
    resolve_store,
    spans_hosts,
)

MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def _config(**kw: object) -> Config:
    return Config.resolve(kw, env={})


def test_store_and_run_id_resolution() -> None:
    env = MASTER
    one_host = _config(world_size=4, local_world_size=4)
    two_hosts = _config(world_size=8, local_world_size=4)
    assert not spans_hosts(one_host, env) and spans_hosts(two_hosts, env)
    assert spans_hosts(_config(), {"SLURM_NNODES": "2"})
    assert resolve_store(one_host, env) == (None, "the job runs on one host")
    assert resolve_store(two_hosts, env) == ("node0:29500", "MASTER_ADDR/MASTER_PORT (the job spans hosts)")
    assert resolve_store(two_hosts, {"MASTER_ADDR": "[::1]", "MASTER_PORT": "0029500"})[0] == "::1:29500"
    none, why = resolve_store(two_hosts, {})  # spans hosts, but no address: warned, no bridge
    assert none is None and "MASTER_ADDR/MASTER_PORT are not set" in why
    assert resolve_store(two_hosts, {"MASTER_ADDR": "node0", "MASTER_PORT": "x"})[0] is None
    assert resolve_store(two_hosts, {"MASTER_PORT": "1"})[0] is None
    off = resolve_store(_config(store="off", world_size=8, local_world_size=4), env)
    assert off == (None, "store=off (keyword argument)")
    assert resolve_store(_config(store="10.0.0.1:1234"), {}) == ("10.0.0.1:1234", "keyword argument")
    assert resolve_run_id(two_hosts, env) == "master-node0:29500"
    assert resolve_run_id(two_hosts, {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "2"}) == "torchrun-job-r2"
    assert resolve_run_id(two_hosts, {"TORCHELASTIC_RUN_ID": "job", "SLURM_JOB_ID": "7"}) == "torchrun-job-r0"
    assert resolve_run_id(two_hosts, {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", **env}) == "slurm-77.0"
    assert resolve_run_id(two_hosts, {"SLURM_JOB_ID": "77"}) == "slurm-77.batch"
    assert resolve_run_id(_config(run_id="mine"), env) == "mine"
    assert resolve_run_id(two_hosts, {}) is None
    assert resolve_run_id(two_hosts, {"MASTER_ADDR": "node0"}) is None
    assert key_prefix("mine") == "peerwatch/mine/"


@pytest.mark.parametrize("var", ["SLURM_NNODES", "SLURM_JOB_NUM_NODES", "GROUP_WORLD_SIZE"])
def test_node_counts_from_the_launcher(var: str) -> None:
    assert spans_hosts(_config(), {var: "2"})
    assert not spans_hosts(_config(), {var: "1"})
    assert not spans_hosts(_config(), {var: "x"})
    assert expected_hosts(_config(), {var: "3"}) == 3
    assert expected_hosts(_config(), {var: "1"}) == 1
    assert expected_hosts(_config(), {var: "0"}) is None
    assert expected_hosts(_config(), {var: ""}) is None


def test_world_sizes_say_how_many_hosts() -> None:
    assert not spans_hosts(_config(world_size=4, local_world_size=4), {})
    assert spans_hosts(_config(world_size=5, local_world_size=4), {})
    assert not spans_hosts(_config(world_size=8), {})
    assert expected_hosts(_config(world_size=8, local_world_size=4), {"SLURM_NNODES": "9"}) == 2
    assert expected_hosts(_config(world_size=9, local_world_size=4), {}) == 3  # rounded up
    assert expected_hosts(_config(world_size=4, local_world_size=4), {}) == 1
    assert expected_hosts(_config(world_size=8), {}) is None


def test_facts_resolved_once_with_the_config() -> None:
    config = _config(world_size=8, local_world_size=4)
    facts = LauncherFacts.resolve(config, MASTER)
    assert facts == LauncherFacts(wants_store=True, spans_hosts=True, store="node0:29500",
                                  store_why="MASTER_ADDR/MASTER_PORT (the job spans hosts)",
                                  run_id="master-node0:29500", expected_hosts=2)
    assert facts.ready and facts.address == "node0:29500" and facts.key_prefix == "peerwatch/master-node0:29500/"
    with pytest.raises(AttributeError):
        facts.store = None  # type: ignore[misc]  # frozen


def test_facts_before_the_launcher_says_where_the_store_is() -> None:
    facts = LauncherFacts.resolve(_config(world_size=8, local_world_size=4), {})
    assert facts.wants_store and not facts.ready
    assert facts.store is None and facts.run_id is None and facts.address == "" and facts.key_prefix == ""
    # A store but no name for the job: not ready either.
    facts = LauncherFacts.resolve(_config(store="h:1"), {})
    assert facts.wants_store and not facts.spans_hosts and facts.store == "h:1" and not facts.ready


def test_no_store_wanted_on_one_host_or_when_off() -> None:
    assert not LauncherFacts.resolve(_config(world_size=4, local_world_size=4), MASTER).wants_store
    assert not LauncherFacts.resolve(_config(store="off", world_size=8, local_world_size=4), MASTER).wants_store
    assert LauncherFacts.resolve(_config(store="h:1", world_size=4, local_world_size=4), {}).wants_store


def test_a_store_object_is_named_by_its_type() -> None:
    class FakeStore:
        def set(self) -> None: ...
        def get(self) -> None: ...
        def compare_set(self) -> None: ...

    facts = LauncherFacts.resolve(_config(store=FakeStore(), run_id="r"), {})
    assert facts.ready and facts.address == "FakeStore"


def test_without_env_the_process_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "node7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    facts = LauncherFacts.resolve(_config())
    assert (facts.spans_hosts, facts.expected_hosts, facts.store, facts.run_id) == (
        True, 3, "node7:29511", "master-node7:29511")


def test_spans_hosts_answers_true_or_false() -> None:
    assert spans_hosts(_config(), {}) is False
    assert spans_hosts(_config(), {"SLURM_NNODES": "1", "GROUP_WORLD_SIZE": "x"}) is False
    assert spans_hosts(_config(world_size=8, local_world_size=4), {}) is True
