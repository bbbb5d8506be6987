"""``stream``'s options: how many layers' weights are copied ahead of the one computing."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate


@dataclass
class StreamOptions:
    """Knobs of frozen-weight streaming."""

    ahead: int = 1  # layers whose weights are copied to the device while the current one computes

    def __post_init__(self):
        validate.positive_int("stream", "ahead", self.ahead, minimum=0, maximum=8)
