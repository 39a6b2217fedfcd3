"""`--json` across the CLI: every command that prints data takes it, and an error under it
is one JSON object on stderr, `{"error": ..., "exit_code": N}`, with the documented exit
code and nothing on stdout (cli/common.py `fail`). In process (typer's runner around the
whole `node` app, usage errors included): no node is started, so these are fast.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from protocols import manifest as mf
from testnet import launcher

RUN_ID = mf.run_id(b"a run nobody holds")  # well-formed


def node(*args: str) -> tuple[int, str, str]:
    """Run `node ARGS` in this process as the installed command does (App.__call__, which
    turns usage errors and bugs into one line too); (exit code, stdout, stderr)."""
    with CliRunner().isolation() as (stdout, stderr, _):
        try:
            app(list(args), prog_name="node")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        return code, stdout.getvalue().decode(), stderr.getvalue().decode()


@pytest.fixture
def where(tmp_path: Path) -> dict[str, str]:
    """Paths the cases name: an empty state dir, a testnet dir holding no testnet, a bad
    config file, an existing config file, a manifest that does not parse."""
    (tmp_path / "bad.toml").write_text("[join]\nno_such_key = 1\n")
    (tmp_path / "exists.toml").write_text("")
    (tmp_path / "manifest.toml").write_text("[run\n")
    return {"state": str(tmp_path / "state"), "testnet": str(tmp_path / "tn"),
            "bad_config": str(tmp_path / "bad.toml"), "config": str(tmp_path / "exists.toml"),
            "manifest": str(tmp_path / "manifest.toml")}


# (command line with {placeholders} from `where`, the documented exit code)
CASES = [
    ("run create {manifest} --json", 2),
    ("run create /no/such/manifest.toml --json", 2),
    ("run show {manifest} --json", 2),
    ("run ticket not-a-run-id --json", 2),
    (f"run ticket {RUN_ID} --state-dir {{state}} --json", 1),  # no node running there
    ("status --state-dir {state} --json", 1),
    ("status --state-dir {state} --json --watch --interval 0", 2),
    ("status --json --interval soon", 2),  # a usage error (not a number)
    ("logs --state-dir {state} --json", 1),  # no node.log
    ("logs --state-dir {state} --json --lines 0", 2),
    ("ckpt ls --state-dir {state} --json --no-such-flag", 2),
    ("ckpt verify not-a-cid --state-dir {state} --json", 2),
    ("ckpt pull not-a-cid --state-dir {state} --json", 2),
    ("ckpt pull not-a-cid --state-dir {state} --json --timeout 0", 2),
    ("config show --config {bad_config} --json", 2),
    ("config path --json --config", 2),  # the option's value is missing
    ("config init --config {config} --json", 1),  # exists, no --force
    ("testnet up --json --nodes 0 --dir {testnet}", 2),
    ("testnet up --json --page nowhere --dir {testnet}", 2),
    ("testnet up --json --scenario mars --dir {testnet}", 2),
    ("testnet status --json --dir {testnet}", 1),  # no testnet there
    ("testnet down --json --dir", 2),
    ("testnet logs --json --lines 0 --dir {testnet}", 2),
    ("testnet partition --json --dir {testnet}", 1),
    ("testnet page --json --listen 127.0.0.1:99999 --dir {testnet}", 2),
    ("testnet page --json --dir {testnet}", 1),
]


@pytest.mark.parametrize(("line", "code"), CASES, ids=[c[0] for c in CASES])
def test_an_error_under_json_is_one_json_object(where, line, code):
    exit_code, stdout, stderr = node(*line.format(**where).split())
    assert exit_code == code, (stdout, stderr)
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    doc = json.loads(lines[0])
    assert doc["exit_code"] == code and doc["error"], doc
    # The same command without --json says it as a person reads it, with the same code.
    plain = [a for a in line.format(**where).split() if a != "--json"]
    exit_code, _, stderr = node(*plain)
    assert exit_code == code and stderr.startswith("error: "), stderr


def test_a_taken_page_port_is_a_json_error(tmp_path):
    """`node testnet page --listen` on a port in use: exit 2, said in JSON, nothing served."""
    launcher.Testnet(str(tmp_path), RUN_ID, "", [], True, 0).save()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, stdout, stderr = node("testnet", "page", "--dir", str(tmp_path), "--listen",
                                    f"127.0.0.1:{port}", "--json")
    assert code == 2 and stdout == ""
    assert json.loads(stderr) == {
        "error": json.loads(stderr)["error"], "exit_code": 2}
    assert f"127.0.0.1:{port}: cannot listen there" in json.loads(stderr)["error"]
    assert not (tmp_path / "page.json").exists()


def test_json_results_parse(tmp_path):
    """What the data commands print under --json is one JSON document each."""
    from testnet.launcher import default_manifest_path

    state = str(tmp_path / "state")
    manifest = str(default_manifest_path())
    code, out, _ = node("run", "create", manifest, "--state-dir", state, "--json")
    assert code == 0
    run_id = json.loads(out)["run_id"]
    code, out, _ = node("run", "show", manifest, "--json")
    assert code == 0 and json.loads(out)["run_id"] == run_id
    assert json.loads(out)["manifest"]["run"]["name"]
    code, out, _ = node("ckpt", "ls", "--state-dir", state, "--json")
    assert code == 0 and json.loads(out)["checkpoints"] == []
    config = tmp_path / "peertrain.toml"
    code, out, _ = node("config", "path", "--config", str(config), "--json")
    assert code == 0 and json.loads(out) == {"path": str(config), "exists": False}
    code, out, _ = node("config", "init", "--config", str(config), "--json")
    assert code == 0 and json.loads(out) == {"path": str(config)}
    code, out, _ = node("config", "show", "--config", str(config), "--json")
    assert code == 0 and json.loads(out)["exists"] is True
    code, out, _ = node("testnet", "down", "--dir", str(tmp_path / "tn"), "--json")
    assert code == 0 and json.loads(out)["stopped"] == 0


def test_json_after_a_double_dash_is_an_argument_not_the_flag():
    from cli.common import asks_json

    assert asks_json(["status", "--json"])
    assert not asks_json(["testnet", "logs", "--", "--json"])
