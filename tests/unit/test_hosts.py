"""varuna/elastic/hosts.py and the hostfile's hosts: where the controller listens, which host is dead,
the hostfile left after losing one. The jobs across hosts are in tests/multihost/test_multihost_jobs.py."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from varuna.elastic import hosts
from varuna.elastic.hosts import (
    HostWatch,
    check_dead_after,
    controller_interface,
    dead_hosts,
    hostfile_without,
    remote_hosts,
)
from varuna.errors import ConfigError
from varuna.launch.hostfile import hostfile_hosts, hostfile_slots


def test_hostfile_hosts_in_every_form_in_order(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode3 slots=4\nnode1\n\nnode2:2  # two\nnode1:3\n")
    assert hostfile_hosts(path) == {"node3": 4, "node1": 4, "node2": 2}
    assert list(hostfile_hosts(path)) == ["node3", "node1", "node2"]
    assert hostfile_slots(path) == 10


def test_one_host_jobs_stay_on_loopback(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    assert controller_interface(None) == "127.0.0.1"
    path.write_text(f"localhost:2\n{socket.gethostname()}:2\n127.0.0.1\n")
    assert controller_interface(path) == "127.0.0.1"
    assert remote_hosts(["localhost", socket.gethostname()]) == []


def test_a_hostfile_naming_another_host_binds_toward_it(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "hosts"
    path.write_text("localhost:2\nnode7:2\nnode8:2\n")
    monkeypatch.setattr(hosts, "_is_local", lambda name: name == "localhost")
    asked: list[list[str]] = []
    monkeypatch.setattr(hosts, "outbound_ip", lambda peers: asked.append(peers) or "10.1.2.3")
    assert controller_interface(path) == "10.1.2.3"
    assert asked == [["node7", "node8"]]


def test_a_host_is_dead_when_all_its_ranks_are_silent_and_another_speaks() -> None:
    where = {0: "h2", 1: "h2", 2: "h3", 3: "h3"}
    assert dead_hosts(where, {2: 6.0, 3: 5.0}, 5.0) == ["h3"]
    assert dead_hosts(where, {2: 6.0, 3: 4.9}, 5.0) == []  # one rank of h3 still speaks
    assert dead_hosts(where, {0: 6, 1: 6, 2: 6, 3: 6}, 5.0) == []  # all quiet: the controller is cut off
    assert dead_hosts({0: "h2", 1: "h2"}, {0: 9.0, 1: 9.0}, 5.0) == []  # one host: nowhere to go


def test_host_watch_names_a_silent_host_once_per_launch() -> None:
    watch = HostWatch(dead_after_s=0.2)
    for rank, host in enumerate(["h2", "h2", "h3", "h3"]):
        watch.see({"type": "hello", "rank": rank, "job": "j1", "host": host})
    where = {0: "h2", 1: "h2", 2: "h3", 3: "h3"}
    assert watch.check("j1", where) == []
    import time

    time.sleep(0.25)
    for rank in (0, 1):
        watch.see({"type": "heartbeat", "rank": rank, "job": "j1", "host": "h2", "action": "step 1"})
    (found,) = watch.check("j1", where)
    assert found[:2] == ("h3", [2, 3]) and found[2] >= 0.2
    assert watch.check("j1", where) == []
    note = {
        "type": "host_dead",
        "host": "h3",
        "reason": "no word from any rank on h3 for 5.2 s",
        "ranks": [2, 3],
    }
    assert hosts.host_down(note) == "host h3 is down: no word from any rank on h3 for 5.2 s; its ranks [2, 3]"
    assert hosts.host_down({"type": "hello"}) is None


@pytest.mark.parametrize("bad", [0, -1.0, True, "5", float("inf")])
def test_dead_after_must_be_positive_seconds(bad) -> None:
    with pytest.raises(ConfigError, match=r"dead_after_s must be a number of seconds > 0 .* got"):
        check_dead_after(bad)


def test_hostfile_without_a_lost_host(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("h2:2\nh3:2\n")
    left = hostfile_without(path, ["h3"], tmp_path / "agent")
    assert left == tmp_path / "agent" / "hosts-2" and left.read_text() == "h2:2\n"
    note = json.loads((tmp_path / "agent" / "hosts-lost.json").read_text())
    assert note == {"from": str(path), "lost": ["h3"], "left": {"h2": 2}}
    with pytest.raises(ConfigError, match=r"no host of .* is left after losing h2, h3: add hosts"):
        hostfile_without(path, ["h2", "h3"], tmp_path / "agent")


HYDRA_KILLED = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 1803 RUNNING AT h3
=   EXIT CODE: {code}
=   CLEANING UP REMAINING PROCESSES
"""
HYDRA_UNREACHABLE = (
    '[proxy:1@h3.cluster] HYDU_sock_connect (sock.c:140): unable to connect from "h3" to "h1" (No route to host)\n'
    "[mpiexec@h1] ui_cmd_cb (pmiserv_pmci.c:51): Launch proxy failed.\n"
)


def test_mpiexec_names_the_lost_host_only_for_sigkill_or_no_connection() -> None:
    assert hosts.lost_in_console(HYDRA_KILLED.format(code=9), ["h2", "h3"]) == ("h3", "killed")
    assert (
        hosts.lost_in_console(HYDRA_KILLED.format(code=1), ["h2", "h3"]) is None
    )  # a Python error: not the host
    assert hosts.lost_in_console(HYDRA_KILLED.format(code=11), ["h2", "h3"]) is None  # a crash: not the host
    assert hosts.lost_in_console(HYDRA_UNREACHABLE, ["h2", "h3"]) == ("h3", "unreachable")
    assert hosts.lost_in_console(HYDRA_UNREACHABLE, ["h2", "h4"]) is None  # not a host of this hostfile


class _Launch:
    """What the agent reads of a finished launch: its id and mpiexec's output."""

    def __init__(self, job_id: str, console: str = "") -> None:
        self.job_id, self._tail = job_id, console.encode()


def _agent(tmp_path: Path):
    from varuna.elastic import agent

    hostfile = tmp_path / "hosts"
    hostfile.write_text("h2:2\nh3:2\n")
    (tmp_path / "engine.json").write_text(
        json.dumps(
            {"pipeline": 2, "data": 2, "global_batch_size": 16, "micro_batch_size": 2, "num_segments": 4}
        )
    )
    return agent, agent.Agent(
        tmp_path, {"argv": ["x.py"], "pipeline": 2, "data": 2, "hostfile": str(hostfile)}
    )


def test_the_agent_drops_the_host_mpiexec_names_and_keeps_the_global_batch(tmp_path: Path) -> None:
    from varuna.elastic.protocol import Shape

    agent, me = _agent(tmp_path)
    assert me.hosts_lost(_Launch("j1", HYDRA_KILLED.format(code=1)), 1, None) == set()  # a Python error
    launch = _Launch("j1", HYDRA_KILLED.format(code=9))
    assert me.hosts_lost(launch, 255, None) == {"h3"}
    note = json.loads((tmp_path / agent.NOTES).read_text().splitlines()[-1])
    assert (note["type"], note["host"], note["how"]) == ("host_dead", "h3", "killed")
    assert me.hosts_lost(launch, 255, "stop") == set()  # the user stopped it: their signal, not a dead host
    assert me.drop_hosts({"h3"}, launch, Shape(2, 2)) == Shape(2, 1)  # 2 slots left, 16 = 1 x 8 x 2
    assert me.hostfile is not None and me.hostfile.read_text() == "h2:2\n"


def test_the_agent_takes_host_intents_only_for_the_launch_they_name(tmp_path: Path) -> None:
    agent, me = _agent(tmp_path)
    me.current = "j2"
    agent.write_intent(tmp_path, "host_lost", hosts=["h3"], job="j1")  # about a launch that is over
    assert me.read_intent() is None and me.lost_now == set()
    agent.write_intent(tmp_path, "exclude", after=me._intent_seq, hosts=["h2"], job="j2")
    assert me.read_intent() == "exclude" and me.lost_now == {"h2"}
    assert me.hosts_lost(_Launch("j2"), 75, "exclude") == {"h2"}  # after the checkpointed morph exit
