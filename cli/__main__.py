"""`python -m cli ...` is `node ...`: the testnet launcher starts nodes this way."""

from cli.main import app

app()
