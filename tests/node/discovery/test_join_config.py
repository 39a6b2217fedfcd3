"""The config file (node/config_file.py), join tickets (protocols/ticket.py), remembered
peers (node/discovery/remembered.py), shareable addresses, and the CLI's merge of flags,
environment and config: pure functions and `node config` commands, no node process."""

from __future__ import annotations

import json
import string
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node import config_file as cf
from node.discovery import remembered
from node.discovery.addrs import shareable
from protocols import manifest as mf
from protocols import ticket as tk
from tests.conftest import cli

RUN = mf.run_id(b"a run")
PEER = "12D3KooWMjaBEkKWfJNw1JoiV6UqwyqrtfienDAHyutXwAgii5RE"
BOOT = f"/ip4/203.0.113.7/tcp/4101/p2p/{PEER}"

# -- config file ------------------------------------------------------------------------


def test_a_full_config_parses_and_the_command_table_wins():
    c = cf.parse(f"""
state-dir = "/srv/pt"
bootstrap = ["{BOOT}"]
listen = ["/ip4/0.0.0.0/tcp/0"]
log-level = "warning"
mdns = false
[join]
device = "cpu"
join-timeout = 60
no-train = true
log-level = "debug"
heartbeat-target = 20.0
want-peers = 4
max-peers = 16
rundoc-horizon = 600.0
[bootstrap-node]
listen = ["/ip4/0.0.0.0/tcp/4101"]
announce = ["/ip4/203.0.113.7/tcp/4101"]
""")
    join = c.for_command("join")
    assert join["state_dir"] == "/srv/pt" and join["bootstrap"] == [BOOT]
    assert join["log_level"] == "debug" and join["device"] == "cpu"
    assert join["join_timeout"] == 60 and join["no_train"] is True and join["mdns"] is False
    assert (join["heartbeat_target"], join["want_peers"], join["max_peers"],
            join["rundoc_horizon"]) == (20.0, 4, 16, 600.0)
    boot = c.for_command("bootstrap")
    assert boot["listen"] == ["/ip4/0.0.0.0/tcp/4101"] and boot["log_level"] == "warning"
    assert "device" not in boot
    assert cf.parse(cf.render(c)) == c  # `node config show` prints what parses back


def test_the_template_parses_to_nothing_set():
    assert cf.parse(cf.TEMPLATE).for_command("join") == {}


@pytest.mark.parametrize(("text", "says"), [
    ("bootstrapp = []", "bootstrapp: unknown key 'bootstrapp' at the top level "
                        "(did you mean 'bootstrap'?)"),
    ("[join]\ndevise = 'cpu'", "join.devise: unknown key 'devise' in [join] (did you mean "
                               "'device'?)"),
    ("[join]\njoin-timeout = -1", "join.join-timeout: must be > 0"),
    ("[join]\njoin-timeout = '30'", "join.join-timeout: must be a number"),
    ("mdns = 'yes'", "mdns: must be true or false"),
    ("[join]\nheartbeat-target = 0.0", "join.heartbeat-target: must be > 0"),
    ("[join]\nwant-peers = -1", "join.want-peers: must be >= 0"),
    ("[join]\nwant-peers = 2.5", "join.want-peers: must be an integer"),
    ("[join]\nmax-peers = 0", "join.max-peers: must be >= 1"),
    ("[join]\nrundoc-horizon = -5.0", "join.rundoc-horizon: must be > 0"),
    ("log-level = 'loud'", "log-level: must be 'debug', 'info', 'warning' or 'error'"),
    ("bootstrap = ['/ip4/1.2.3.4/tcp/1']", "bootstrap[0]: must be a peer multiaddr"),
    ("bootstrap = '/ip4/1.2.3.4/tcp/1/p2p/x'", "bootstrap: must be an array"),
    ("listen = ['0.0.0.0:4001']", "listen[0]: must be a multiaddr"),
    ("[join]\nattack = 'x'", "join.attack: must be 'label-flip' or 'backdoor'"),
    ("[join", "invalid TOML"),
    ("join = 3", "join: must be a table"),
])
def test_bad_config_names_the_key(text, says):
    with pytest.raises(cf.ConfigFileError) as e:
        cf.parse(text, "c.toml")
    assert str(e.value).startswith("c.toml: ") and says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_an_oversized_or_binary_config_is_refused_before_parsing():
    with pytest.raises(cf.ConfigFileError, match="too large"):
        cf.parse(b"#" * (cf.MAX_CONFIG_BYTES + 1))
    with pytest.raises(cf.ConfigFileError, match="not UTF-8"):
        cf.parse(b"a = '\xff'")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300)))
def test_any_bytes_parse_or_give_a_config_error(data):
    try:
        cf.parse(data)
    except cf.ConfigFileError as e:
        assert str(e).startswith("<config>: ")


# -- tickets ------------------------------------------------------------------------------


def test_a_ticket_round_trips_and_is_short():
    addrs = [f"/ip4/203.0.113.7/tcp/4101/p2p/{PEER}", "/ip4/192.168.1.20/tcp/4101",
             "/dns4/boot.example.org/tcp/4101"]
    text = tk.encode(RUN, PEER, addrs)
    assert text.startswith("pt1") and len(text) < 250 and text.isalnum()
    t = tk.decode(f"  {text}\n")
    assert (t.run_id, t.peer_id) == (RUN, PEER)
    assert t.addrs == ("/ip4/203.0.113.7/tcp/4101", "/ip4/192.168.1.20/tcp/4101",
                       "/dns4/boot.example.org/tcp/4101")
    assert t.peer_addrs()[0] == f"/ip4/203.0.113.7/tcp/4101/p2p/{PEER}"


@pytest.mark.parametrize(("text", "says"), [
    ("pt2abc", "unsupported ticket version 'pt2'"),
    ("pt1", "not base58"),
    ("pt1O0Il", "not base58"),
    ("pt1" + "z" * 3000, "too long"),
    ("pt1" + "2" * 40, "damaged ticket"),
])
def test_bad_tickets_say_why(text, says):
    with pytest.raises(tk.TicketError, match=says):
        tk.decode(text)


def test_a_cut_ticket_is_refused():
    text = tk.encode(RUN, PEER, ["/ip4/203.0.113.7/tcp/4101"])
    with pytest.raises(tk.TicketError):
        tk.decode(text[:-5])


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=string.ascii_letters + string.digits + "/ ", max_size=400))
def test_any_text_decodes_or_gives_a_ticket_error(text):
    try:
        t = tk.decode("pt1" + text)
    except tk.TicketError:
        return
    assert mf.validate_run_id(t.run_id) == t.run_id and 1 <= len(t.addrs) <= tk.MAX_ADDRS


# -- remembered peers and addresses ------------------------------------------------------


def test_remembered_peers_merge_newest_first_bounded_and_skip_ourselves(tmp_path: Path):
    old = [{"peer": f"p{i}", "addrs": [f"/ip4/10.0.0.{i}/tcp/1"], "seen": 1000.0 + i}
           for i in range(40)]
    merged = remembered.merge(old, {"new": ["/ip4/10.1.1.1/tcp/2", "/ip4/0.0.0.0/tcp/2"],
                                    "me": ["/ip4/10.9.9.9/tcp/1"]}, 2000.0, me="me")
    assert len(merged) == remembered.MAX_PEERS and merged[0]["peer"] == "new"
    assert merged[0]["addrs"] == ["/ip4/10.1.1.1/tcp/2"]
    assert all(p["peer"] != "me" for p in merged) and merged[1]["peer"] == "p39"
    remembered.save(tmp_path, RUN, merged)
    assert remembered.load(tmp_path, RUN) == merged
    assert remembered.addresses(merged)[0] == "/ip4/10.1.1.1/tcp/2/p2p/new"
    assert remembered.load(tmp_path, mf.run_id(b"other")) == []


async def test_remembered_peers_are_written_off_the_trio_thread(tmp_path: Path, monkeypatch):
    """The write's fsync waits for the disk; on the trio thread every stream waited too."""
    writers = []

    def save(*args):
        writers.append(threading.current_thread())
        real_save(*args)

    real_save = remembered.save
    monkeypatch.setattr(remembered, "save", save)
    keeper = remembered.RememberPeers(tmp_path, RUN, "me",
                                      seen=lambda: {"p1": ["/ip4/10.0.0.1/tcp/1"]})
    await keeper.update()
    assert writers and writers[0] is not threading.main_thread()
    assert [p["peer"] for p in remembered.load(tmp_path, RUN)] == ["p1"]


@pytest.mark.parametrize("content", [b"{", b"[]", b'{"version": 2}', b"\xff" * 10,
                                     b'{"version":1,"run":"R","peers":[{"peer":1}]}'])
def test_a_damaged_peers_file_reads_as_empty(tmp_path: Path, content: bytes):
    remembered.path_for(tmp_path, RUN).write_bytes(content.replace(b'"R"', json.dumps(
        RUN).encode()))
    assert remembered.load(tmp_path, RUN) == []


def test_shareable_addresses_put_announced_first_and_drop_loopback_when_others_exist():
    addrs = [f"/ip4/127.0.0.1/tcp/5/p2p/{PEER}", f"/ip4/192.168.1.2/tcp/5/p2p/{PEER}",
             f"/ip4/203.0.113.7/tcp/4101/p2p/{PEER}"]
    assert shareable(addrs, ["/ip4/203.0.113.7/tcp/4101"]) == [addrs[2], addrs[1]]
    assert shareable(addrs[:1], []) == addrs[:1]  # a one-machine testnet keeps loopback


# -- the CLI: `node config`, and flags over environment over file ------------------------


def test_node_config_init_show_and_path(tmp_path: Path):
    path = tmp_path / "c" / "config.toml"
    r = cli("config", "init", "--config", str(path))
    assert r.returncode == 0 and path.exists(), r.stderr
    r = cli("config", "init", "--config", str(path))
    assert r.returncode == 1 and "exists" in r.stderr
    path.write_text(f'bootstrap = ["{BOOT}"]\n[join]\ndevice = "cpu"\n')
    r = cli("config", "show", "--config", str(path))
    assert r.returncode == 0 and f'bootstrap = ["{BOOT}"]' in r.stdout
    assert 'device = "cpu"' in r.stdout
    r = cli("config", "path", "--config", str(path))
    assert r.stdout.strip() == str(path)


def test_flags_override_environment_and_config(monkeypatch, tmp_path: Path):
    from cli import config_cmd

    path = tmp_path / "c.toml"
    path.write_text(f'bootstrap = ["{BOOT}"]\n[join]\ndevice = "cpu"\njoin-timeout = 5\n')
    defaults = {"bootstrap": [], "device": "auto", "join_timeout": 30.0}
    monkeypatch.delenv(config_cmd.BOOTSTRAP_ENV, raising=False)
    v = config_cmd.effective("join", path, {"device": "cuda"}, defaults)
    assert v["device"] == "cuda" and v["join_timeout"] == 5 and v["bootstrap"] == [BOOT]
    assert v["bootstrap_from"] == f"the config file {path}"
    env = [f"/ip4/10.0.0.1/tcp/1/p2p/{PEER}", f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}"]
    monkeypatch.setenv(config_cmd.BOOTSTRAP_ENV, f"{env[0]}, {env[1]}")
    v = config_cmd.effective("join", path, {}, defaults)
    assert v["bootstrap"] == env and v["bootstrap_from"] == "PEERTRAIN_BOOTSTRAP"
    v = config_cmd.effective("join", path, {"bootstrap": [BOOT]}, defaults)
    assert v["bootstrap"] == [BOOT] and v["bootstrap_from"] == "--bootstrap"


@pytest.mark.parametrize(("command", "table"), [("join", "join"), ("bootstrap", "bootstrap-node")])
def test_every_flag_of_the_command_is_a_config_key(command, table):
    """A flag added to `node join`/`node bootstrap` must be settable in the config file."""
    import typer.main

    from cli.main import app

    click_cmd = typer.main.get_command(app).commands[command]
    flags = {o.lstrip("-") for p in click_cmd.params if p.param_type_name == "option"
             for o in p.opts if o.startswith("--")}
    flags -= {"config", "help"}
    model = cf.JoinKeys if command == "join" else cf.BootstrapKeys
    keys = {f.alias or name for name, f in model.model_fields.items()}
    keys |= {k.replace("_", "-") for k in model.model_fields}
    assert flags <= keys, f"flags missing from [{table}]: {sorted(flags - keys)}"
