"""`outer.codec = "auto"`: the codec follows the path to each partner (docs/training.md).

A run that names a codec sends every exchange in it. With "auto" the initiator offers
bf16 (half of fp32's bytes, what the demo run sends) unless the path to that partner calls
for int8 (a quarter): a relayed path (every byte crosses a volunteer's relay, with its
byte budget), or a measured rate at which bf16 would take more than AUTO_SHARE of a round.
The responder takes the first offered codec it supports, so one side decides, and both
sides of an "auto" run support all three.
"""

from __future__ import annotations

from protocols import codecs as _codecs

AUTO = "auto"
AUTO_SHARE = 0.25  # an exchange may take this share of a round before auto shrinks it
_AUTO_SUPPORTED = ("bf16", "int8", "fp32")


def supported(codec: str) -> list[str]:
    """What a node of a run with this `outer.codec` accepts, in its order of preference."""
    if codec == AUTO:
        return list(_AUTO_SUPPORTED)
    if codec == "topk":  # a topk run's trainer hands over frames only: no dense fallback
        return [codec]
    return [codec] if codec == "fp32" else [codec, "fp32"]


def offer(codec: str, numel: int, *, path: str, wire_rate: float | None,
          round_s: float) -> list[str]:
    """The codecs an initiator offers a partner, most wanted first.

    `wire_rate`: bytes per second measured over earlier swaps with this partner (both
    directions together; None before the first); `round_s`: the round's expected length."""
    if codec != AUTO:
        return supported(codec)
    small = ["int8", "bf16", "fp32"]
    if path.startswith("relayed"):
        return small
    if wire_rate is not None and wire_rate > 0:
        swap_s = 2 * _codecs.max_encoded_size("bf16", numel) / wire_rate
        if swap_s > AUTO_SHARE * round_s:
            return small
    return list(_AUTO_SUPPORTED)
