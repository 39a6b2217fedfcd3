"""`python -m cli ...` is `node ...`: the testnet launcher starts nodes this way."""

from cli.main import app

app(prog_name="node")  # usage lines and shell completion ($_NODE_COMPLETE) say `node`
