"""Signed peer records in the DHT (`/ptpeer/<id>`, protocols/records.py): the validator the
DHT checks every record with (p2p/ never sees protocols/), and the service that keeps this
node's own record (addresses, runs served) fresh."""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
from libp2p.records.validator import Validator

from node.service import NodeContext
from protocols import records
from protocols.errors import RemoteProtocolError

log = logging.getLogger("node.membership")


class PeerRecordValidator(Validator):
    def validate(self, key: str, value: bytes) -> None:
        try:
            records.decode(key, value)
        except RemoteProtocolError as e:
            raise ValueError(str(e)) from e

    def select(self, key: str, values: list[bytes]) -> int:
        return records.select(key, values)


VALIDATORS = {records.NAMESPACE: PeerRecordValidator()}


class PeerRecordService:
    """Re-puts our signed record every `interval_s` (records expire; addresses change)."""

    name = "peer_record"
    protocols = ()  # DHT records only

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.puts = 0
        self.failures = 0

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await ctx.substrate.ready.wait()
            dht = ctx.substrate.dht
            assert dht is not None
            runs = [ctx.config.run_id] if ctx.config.run_id else ctx.runs.run_ids()
            value = records.encode(ctx.signer, time.time_ns() // 1_000_000,
                                   ctx.substrate.addrs(), runs)
            try:
                await dht.put(records.peer_key(ctx.peer_id), value)
                self.puts += 1
            except Exception as e:  # e.g. nobody to store it on yet; try again later
                self.failures += 1
                log.debug("peer record put failed: %r", e)
            await trio.sleep(self.interval_s)

    def statistics(self) -> dict[str, Any]:
        return {"puts": self.puts, "failures": self.failures}
