"""mypy over protocols/, p2p/ and node/ ([tool.mypy] in pyproject.toml), clean.

trio ships its own types, but trio-typing (a py-libp2p dependency) installs trio-stubs,
years older (no `trio.TaskStatus`), which mypy prefers to the package's own: trio's
package goes first on mypy's path, through a link in a temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

REPO = Path(__file__).resolve().parents[1]


def test_protocols_p2p_and_node_type_check(tmp_path: Path):
    pytest.importorskip("mypy", reason="mypy is in the test extras (pip install -e '.[test]')")
    (tmp_path / "trio").symlink_to(Path(trio.__file__).parent)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir",
                        str(REPO / ".mypy_cache")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
