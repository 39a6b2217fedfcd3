"""Plugs protocols/records.py into the DHT's validator interface (p2p/ never sees protocols/)."""

from __future__ import annotations

from libp2p.records.validator import Validator

from protocols import records
from protocols.errors import RemoteProtocolError


class PeerRecordValidator(Validator):
    def validate(self, key: str, value: bytes) -> None:
        try:
            records.decode(key, value)
        except RemoteProtocolError as e:
            raise ValueError(str(e)) from e

    def select(self, key: str, values: list[bytes]) -> int:
        return records.select(key, values)


VALIDATORS = {records.NAMESPACE: PeerRecordValidator()}
