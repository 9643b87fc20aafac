"""The lab's pure parts: topology, addresses, names, the forwarder's control lines, the record."""

from __future__ import annotations

import ipaddress

import pytest

from agent.core.lab.topology import (
    LAB_NETWORK,
    LabError,
    LabMachine,
    LabRecord,
    LinkChange,
    LinkSpec,
    MachineSpec,
    Topology,
    check_lab_name,
    forwarder_setup_commands,
    full_mesh,
    link_change_command,
    machine_address,
    namespace_name,
    parse_topology,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_addresses_are_all_in_the_benchmarking_range() -> None:
    assert machine_address(0) == "198.18.0.1"
    assert machine_address(254) == "198.18.0.255"
    assert machine_address(255) == "198.18.1.0"
    for i in (0, 1, 500, 999):
        assert ipaddress.IPv4Address(machine_address(i)) in LAB_NETWORK
    with pytest.raises(LabError):
        machine_address(1000)
    with pytest.raises(LabError):
        machine_address(-1)


def test_names_are_short_and_safe() -> None:
    assert check_lab_name("t123_a") == "t123_a"
    for bad in ("", "A", "a-b", "a b", "x" * 21, "_a", "a/b", "ä"):
        with pytest.raises(LabError, match="use 1-20"):
            check_lab_name(bad)
    assert namespace_name("lab", "m0") == "baton-lab-m0"


def test_link_spec_checks_every_field_by_name() -> None:
    with pytest.raises(LabError, match="delay_ms"):
        LinkSpec(delay_ms=-1)
    with pytest.raises(LabError, match="loss_pct"):
        LinkSpec(loss_pct=101)
    with pytest.raises(LabError, match="rate_mbit"):
        LinkSpec(rate_mbit=float("nan"))
    with pytest.raises(LabError, match="queue_bytes"):
        LinkSpec(queue_bytes=-5)
    with pytest.raises(LabError, match="up"):
        LinkSpec(up=1)  # type: ignore[arg-type]
    with pytest.raises(LabError, match="jitter_ms"):
        LinkSpec(jitter_ms=True)  # type: ignore[arg-type]


def test_forwarder_fields_in_its_units() -> None:
    spec = LinkSpec(delay_ms=10, jitter_ms=0.5, loss_pct=2, rate_mbit=5, queue_bytes=1000, up=False)
    assert spec.forwarder_fields() == "delay_us=10000 jitter_us=500 loss=0.02 rate_bps=5000000 queue_bytes=1000 up=0"
    assert LinkChange(delay_ms=1.25).forwarder_fields() == "delay_us=1250"
    assert LinkChange(up=True).applied_to(spec) == LinkSpec(10, 0.5, 2, 5, 1000, True)
    with pytest.raises(LabError, match="loss_pct"):
        LinkChange(loss_pct=150)


def test_full_mesh_and_its_setup_commands() -> None:
    topology = full_mesh(3, LinkSpec(delay_ms=10), nat=["m2"])
    assert topology.names == ["m0", "m1", "m2"]
    assert topology.address("m2") == "198.18.0.3"
    lines = forwarder_setup_commands(topology)
    links = [line for line in lines if line.startswith("link ")]
    assert len(links) == 6  # every ordered pair
    assert "link 0 1 delay_us=10000 jitter_us=0 loss=0 rate_bps=0 queue_bytes=0 up=1" in links
    assert lines[-1] == "nat 2 on"
    with pytest.raises(LabError, match="--nat names m9"):
        full_mesh(3, nat=["m9"])
    with pytest.raises(LabError, match="2 to"):
        full_mesh(1)


def test_topology_file_with_machines_links_and_access() -> None:
    topology = parse_topology(
        {
            "defaults": {"delay_ms": 10, "loss_pct": 1},
            "machine": [
                {"name": "tracker"},
                {"name": "home1", "nat": True, "uplink_mbit": 5},
                {"name": "home2"},
            ],
            "link": [
                {"between": ["home1", "tracker"], "delay_ms": 40},
                {"from": "home2", "to": "home1", "loss_pct": 0},
            ],
        }
    )
    assert topology.link("home1", "tracker") == LinkSpec(delay_ms=40, loss_pct=1)
    assert topology.link("tracker", "home1") == LinkSpec(delay_ms=40, loss_pct=1)
    assert topology.link("home2", "home1") == LinkSpec(delay_ms=10, loss_pct=0)
    assert topology.link("home1", "home2") == LinkSpec(delay_ms=10, loss_pct=1)  # one way only
    lines = forwarder_setup_commands(topology)
    assert "access 1 uplink_bps=5000000 downlink_bps=0" in lines
    assert "nat 1 on" in lines


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"machines": []}, "unknown section"),
        ({"machine": [{"name": "a"}]}, "2 to"),
        ({"machine": [{"name": "a"}, {"name": "a"}]}, "a given twice"),
        ({"machine": [{"name": "a"}, {"nam": "b"}]}, r"#2: unknown key\(s\) nam"),
        ({"machine": [{"name": "a"}, {}]}, "#2: needs a name"),
        ({"machine": [{"name": "a"}, {"name": "b", "nat": "yes"}]}, "nat: want true"),
        ({"machine": [{"name": "a"}, {"name": "b"}], "link": [{"between": ["a", "c"]}]}, "no machine named 'c'"),
        ({"machine": [{"name": "a"}, {"name": "b"}], "link": [{"between": ["a"]}]}, "two machine names"),
        ({"machine": [{"name": "a"}, {"name": "b"}], "link": [{"from": "a"}]}, "either between"),
        (
            {"machine": [{"name": "a"}, {"name": "b"}], "link": [{"between": ["a", "b"], "delay": 5}]},
            r"#1: unknown key",
        ),
        ({"machine": [{"name": "a"}, {"name": "b"}], "link": [{"between": ["a", "b"], "delay_ms": "5"}]}, "delay_ms"),
        ({"defaults": {"loss_pct": 200}, "machine": [{"name": "a"}, {"name": "b"}]}, r"\[defaults\]: loss_pct"),
        ({"machine": [{"name": "a"}, {"name": "b"}], "link": [{"between": ["a", "a"]}]}, "no link to itself"),
    ],
)
def test_topology_file_errors_name_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(LabError, match=message):
        parse_topology(data)


def test_link_change_command_names_machines_by_index() -> None:
    topology = full_mesh(3)
    assert link_change_command(topology, "m2", "m0", LinkChange(up=False)) == "link 2 0 up=0"
    with pytest.raises(LabError, match="nothing to change"):
        link_change_command(topology, "m0", "m1", LinkChange())
    with pytest.raises(LabError, match="no machine named 'm7'"):
        link_change_command(topology, "m0", "m7", LinkChange(up=False))
    with pytest.raises(LabError, match="itself"):
        link_change_command(topology, "m1", "m1", LinkChange(up=False))


def test_record_round_trips_and_refuses_garbage() -> None:
    topology = Topology(
        (MachineSpec("a", nat=True, uplink_mbit=5), MachineSpec("b")),
        LinkSpec(delay_ms=10),
        (("a", "b", LinkSpec(delay_ms=3)),),
    )
    record = LabRecord(
        "lab", 42, "/run/baton-lab/lab/control.sock", (LabMachine("a", "baton-lab-a", "198.18.0.1"),), topology
    )
    assert LabRecord.from_json(record.to_json()) == record
    assert record.machine("a").address == "198.18.0.1"
    with pytest.raises(LabError, match="no machine 'z'"):
        record.machine("z")
    for garbage in ("{}", "[]", "not json", '{"name": "x"}'):
        with pytest.raises(LabError, match="not a lab record"):
            LabRecord.from_json(garbage)
