"""The testnet table: readable in an 80-column terminal, partners named as the testnet names
them, a node that does not answer shown as such."""

from __future__ import annotations

from rich.console import Console

from cli import render as r

IDS = [f"12D3KooW{c * 44}" for c in "ABCDE"]


def node(i: int, partner: int) -> dict:
    training = {"phase": "training", "step": 1234, "loss": 2.2345, "val_loss": 2.3456,
                "last_partner": IDS[partner], "bytes_sent": 12_000_000,
                "bytes_received": 11_000_000, "compute_fraction": 0.995}
    return {"name": f"node{i}", "status": {"peer_id": IDS[i], "phase": "running",
                                            "role": "node", "membership": {"peers": [1, 2, 3]},
                                            "training": training}}


ROWS = [
    {"name": "bootstrap", "status": {"peer_id": IDS[0], "phase": "running", "role": "bootstrap",
                                     "membership": {"peers": [1, 2, 3, 4]}, "training": None}},
    node(1, 2), node(2, 1), node(3, 4),
    {"name": "node4", "error": "not answering"},
]


def table(width: int) -> list[str]:
    console = Console(width=width, record=True)
    console.print(r.testnet_table(ROWS, "testnet Qm...", width=width))
    return console.export_text().splitlines()


def test_an_80_column_terminal_gets_every_value_whole():
    lines = table(80)
    assert all(len(line.rstrip()) <= 80 for line in lines)
    assert lines[1].split() == ["node", "phase", "peers", "step", "loss", "val", "partner",
                                "MB", "out/in", "compute"]  # no header cut short
    node1 = next(line for line in lines if line.startswith("node1"))
    assert node1.split() == ["node1", "training", "3", "1234", "2.235", "2.346", "node2",
                             "12/11", "100%"]
    assert "not answering" in next(line for line in lines if line.startswith("node4"))
    # a partner outside the testnet keeps its short peer id
    assert "…" + IDS[4][-6:] in next(line for line in lines if line.startswith("node3"))


def test_a_sybil_scenario_in_an_80_column_terminal():
    """Classification runs have no paths column to drop (it crashed `node testnet status`
    on an 80-column terminal: list.remove(x): x not in list)."""
    robust = [{"name": "sybil1", "status": {
        "peer_id": IDS[1], "phase": "running", "role": "node", "membership": {"peers": [1]},
        "training": {"phase": "training", "step": 400, "loss": 0.6,
                     "val_metrics": {"accuracy": 0.797, "label_flip": 0.507, "backdoor": 0.13},
                     "aggregation": {"weights": {"self": 1.0}}}}}]
    console = Console(width=80, record=True)
    console.print(r.testnet_table(robust, "testnet Qm...", width=80))
    lines = console.export_text().splitlines()
    assert lines[1].split() == ["node", "phase", "peers", "step", "loss", "acc", "flip",
                                "backdoor", "sybil", "weight"]
    assert lines[2].split() == ["sybil1", "training", "1", "400", "0.600", "79.7%", "50.7%",
                                "13.0%", "0.0%"]


def test_a_wide_terminal_also_gets_peer_ids():
    text = "\n".join(table(140))
    assert "id" in text.split("\n")[2] and IDS[1][-6:] in text
    assert "node4" in text and "not answering" in text


def test_node_status_lists_banned_peers_only_when_there_are_some():
    st = {"peer_id": IDS[0], "role": "node", "phase": "running", "uptime_s": 5, "addrs": [],
          "p2p": {}, "membership": {"peers": []}, "guard": {"bans": {}}}
    console = Console(width=200, record=True)
    console.print(r.node_status_table(st))
    assert "banned" not in console.export_text()
    st["guard"]["bans"] = {IDS[3]: {"reason": "invalid", "seconds_left": 599.5,
                                    "until_unix": 1_900_000_000.0, "count": 1}}
    console.print(r.node_status_table(st))
    text = console.export_text()
    assert "1 banned peers" in text and IDS[3] in text and "invalid" in text


def test_node_status_says_when_inbound_connections_were_refused():
    st = {"peer_id": IDS[0], "role": "node", "phase": "running", "uptime_s": 5, "addrs": [],
          "p2p": {"connections": 3, "inbound": {"refused": {}}}, "membership": {"peers": []}}
    console = Console(width=200, record=True)
    console.print(r.node_status_table(st))
    assert "refused" not in console.export_text()
    st["p2p"]["inbound"]["refused"] = {"slots_full": 7, "conns_per_peer": 2}
    console = Console(width=200, record=True)
    console.print(r.node_status_table(st))
    assert "3 (DHT table 0); inbound refused: 2 conns_per_peer, 7 slots_full" in (
        console.export_text())


def test_node_status_shows_reachability_and_the_gateways_refusal():
    st = {"peer_id": IDS[0], "role": "node", "phase": "running", "uptime_s": 5, "addrs": [],
          "p2p": {}, "membership": {"peers": []},
          "reach": {"reachability": "public", "via": "upnp", "dht": "server",
                    "upnp": {"mapping": "/ip4/198.18.3.2/tcp/4001", "error": None}}}
    console = Console(width=200, record=True)
    console.print(r.node_status_table(st))
    assert "public via upnp (DHT server); upnp: /ip4/198.18.3.2/tcp/4001" in console.export_text()
    st["reach"] = {"reachability": "private", "via": None, "dht": "client",
                   "upnp": {"mapping": None, "error": "the gateway refused to map TCP port 4001"}}
    console = Console(width=200, record=True)
    console.print(r.node_status_table(st))
    assert ("private (DHT client); upnp: the gateway refused to map TCP port 4001"
            in console.export_text())


def test_node_status_shows_each_peers_path_and_the_relays():
    peers = [{"peer_id": IDS[1], "last_seen_s": 1.0, "addrs": []},
             {"peer_id": IDS[2], "last_seen_s": 2.0, "addrs": []}]
    st = {"peer_id": IDS[0], "role": "node", "phase": "running", "uptime_s": 5, "addrs": [],
          "p2p": {}, "membership": {"peers": peers},
          "relay": {"paths": {IDS[1]: "direct", IDS[2]: f"relayed via {IDS[3]}"},
                    "reservations": {IDS[3]: {}, IDS[4]: {}}, "serving": None, "error": None}}
    console = Console(width=250, record=True)
    console.print(r.node_status_table(st))
    text = console.export_text()
    assert f"reserved on …{IDS[3][-6:]}, …{IDS[4][-6:]}" in text
    rows = {i: next(line for line in text.splitlines() if i in line) for i in IDS[1:3]}
    assert "direct" in rows[IDS[1]] and f"relayed via …{IDS[3][-6:]}" in rows[IDS[2]]


def test_node_status_shows_path_kinds_rtt_and_hole_punching():
    peers = [{"peer_id": IDS[i], "last_seen_s": 1.0, "addrs": []} for i in (1, 2, 3)]
    st = {"peer_id": IDS[0], "role": "node", "phase": "running", "uptime_s": 5, "addrs": [],
          "p2p": {}, "membership": {"peers": peers},
          "relay": {"paths": {IDS[1]: "direct"}},  # the path service's kinds win over these
          "peer_paths": {"peers": {IDS[1]: {"path": "punched", "rtt_ms": 51.4},
                                   IDS[2]: {"path": "upnp", "rtt_ms": None},
                                   IDS[3]: {"path": f"relayed via {IDS[4]}", "rtt_ms": 120}},
                         "by_kind": {"punched": 1, "upnp": 1, "webrtc": 0, "direct": 0,
                                     "relayed": 1}},
          "averaging": {"partners": {IDS[1]: {"wire_mb_per_s": 12.46, "codec": "bf16"},
                                     IDS[3]: {"wire_mb_per_s": 0.3, "codec": "int8"},
                                     IDS[2]: {"wire_mb_per_s": None, "codec": None}}},
          "punch": {"attempts": 3, "punched": 1, "failed": 2, "answered": 1,
                    "answered_punched": 1, "protocol_errors": 0,
                    "error": f"{IDS[3]}: no dial to /ip4/198.18.4.2/tcp/4001 got through"}}
    console = Console(width=250, record=True)
    console.print(r.node_status_table(st))
    text = console.export_text()
    rows = {i: next(line for line in text.splitlines() if i in line and "last" not in line)
            for i in IDS[1:4]}
    assert "punched" in rows[IDS[1]] and "51 ms" in rows[IDS[1]]
    assert "12.5 MB/s bf16" in rows[IDS[1]]  # the last exchange's wire rate and codec
    assert "upnp" in rows[IDS[2]] and "MB/s" not in rows[IDS[2]]
    assert f"relayed via …{IDS[4][-6:]}" in rows[IDS[3]] and "120 ms" in rows[IDS[3]]
    assert "0.3 MB/s int8" in rows[IDS[3]]
    assert "1 punched of 3 tries; answered 1 (1 punched); 0 bad sessions" in text
    assert "clock" not in text  # synchronized: nothing to say
    st["membership"]["clock_offset_s"] = -312.4
    console = Console(width=250, record=True)
    console.print(r.node_status_table(st))
    assert "312 s behind the swarm's" in console.export_text()
    assert r.paths_cell(st["peer_paths"]) == "1p 1u 1r"
    assert r.paths_cell(None) == "-"


def test_pipeline_lines_show_the_replicas_rounds():
    pipe = {"stage": 1, "stages": 2, "phase": "training", "moves": 0,
            "map": {"0": [IDS[0], IDS[1]], "1": [IDS[2], IDS[3]]},
            "replicas": {"rounds_averaged": 7, "rounds_local": 1, "rounds_alone": 0,
                         "last_partner": IDS[3]}}
    rows = dict(r.pipeline_lines(pipe))
    assert rows["replicas"] == (f"7 rounds averaged with this stage's other hosts, 1 local, "
                                f"0 alone; last partner …{IDS[3][-6:]}")
    assert "replicas" not in dict(r.pipeline_lines({**pipe, "replicas": None}))


def pipeline_node(i: int, phase: str, loss_age_s: float | None) -> dict:
    training = {"phase": phase, "step": 251, "loss": 3.3112, "val_loss": None,
                "loss_age_s": loss_age_s, "compute_fraction": 0.4, "last_partner": None}
    pipe = {"stage": 2, "stages": 3, "phase": phase, "moves": 0, "training": training,
            "map": {"0": [IDS[1]], "1": [IDS[2]], "2": [IDS[3]]}}
    return {"name": f"node{i}", "status": {"peer_id": IDS[i], "phase": "running",
                                            "role": "node", "membership": {"peers": [1, 2]},
                                            "pipeline": pipe, "addrs": [], "uptime_s": 600}}


def test_a_stalled_pipeline_says_so_and_its_loss_says_how_old_it_is():
    stalled = "stalled: waiting for stage 1 since 480 s"
    rows = [pipeline_node(1, "training", 0.4), pipeline_node(3, stalled, 480.0)]
    for width in (80, 140):
        console = Console(width=width, record=True)
        console.print(r.testnet_table(rows, "testnet Qm...", width=width))
        text = console.export_text()
        assert all(len(line) <= width for line in text.splitlines())
        # not shown as the current loss
        assert ("3.311 (8 min old)" if width > 100 else "3.311 old") in text
        assert "old" not in next(x for x in text.splitlines() if "node1" in x)  # fresh
        if width > 100:  # the phase wraps, whole
            assert "stalled: waiting for stage 1" in text and "since 480 s" in text
        else:
            assert "stalled>1 8m" in text
    console = Console(width=140, record=True)
    console.print(r.node_status_table({**rows[1]["status"], "run": None, "device": "cpu",
                                       "membership": {"peers": []}}))
    text = console.export_text()
    assert f"stage 2 of 3 ({stalled}; 0 moves)" in text
    assert f"{stalled}: step 251, loss 3.311 (8 min old)" in text
    assert r._short_phase("stalled: waiting for stages 1, 3 (no live host) since 31 s") \
        == "stalled>1,3! 31s"
    assert r._short_phase("stalled: 21 messages queued on this host since 31 s") \
        == "stalled q21 31s"
