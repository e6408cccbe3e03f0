"""A request: its n sequences (one per choice), their output streams and its listener."""

from dataclasses import dataclass, field
from typing import Callable

from xserv_engine.engine.output_stream import OutputStream
from xserv_engine.engine.sequence import Sequence
from xserv_engine.outputs import RequestOutput

OnOutput = Callable[[RequestOutput], None]


@dataclass
class Request:
    request_id: str
    on_output: OnOutput
    seqs: list[Sequence]
    streams: dict[int, OutputStream]  # seq_id -> stream
    unfinished: int = field(init=False)

    def __post_init__(self):
        self.unfinished = len(self.seqs)
