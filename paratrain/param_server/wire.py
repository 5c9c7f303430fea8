"""The parameter server's messages: fixed-layout headers and fp32 tensors, never code.

Workers and servers talk over one gloo group of the whole job (session.py), with tensor sends and
receives only. A message is:

    header   float64[HEADER_LEN], on the request tag (to a server) or the reply tag (to a worker):
             kind, worker, round, lr, factor, value, meta_bytes, payload (the slots of ``Header``)
    meta     meta_bytes bytes of JSON (UTF-8, in a uint8 tensor), on the body tag, when > 0
    payload  payload fp32 elements, on the body tag, when > 0

Nothing received is unpickled or called: a header is eight numbers checked against ``Kind`` and
the bounds below before anything is allocated for its body, JSON is parsed as data, and a tensor
is a tensor. What a message may carry is decided by its kind on the receiving side (session.py,
client.py), which also checks the sizes against what it knows (its parameters' shapes).

float64 slots hold integers exactly up to 2**53, far beyond any round, rank or element count.
gloo keeps the order of sends and receives per peer and tag, so a body follows its header.
"""

from __future__ import annotations

import datetime
import enum
import json
import math
from dataclasses import astuple, dataclass, replace

import torch
import torch.distributed as dist

HEADER_LEN = 8
REQUEST_TAG, BODY_TAG, REPLY_TAG, REPLY_BODY_TAG = 1, 2, 3, 4
MAX_META_BYTES = 64 << 20  # a manifest names parameters and keys: far below this for any model
MAX_PAYLOAD = 1 << 40  # fp32 elements; a receiver checks the exact count it expects as well


class ProtocolError(RuntimeError):
    """A message that does not follow this protocol (a wrong kind, size or manifest)."""


class Kind(enum.IntEnum):
    SETUP = 1  # worker 0: meta {names, shapes, optim}, payload the initial values; reply: ack
    PUSH_SYNC = 2  # round, payload the gradients; reply (when all dp are in): value = squared norm
    APPLY_SYNC = 3  # round, factor, lr; reply: payload the new values
    PUSH_ASYNC = 4  # round = the ticket, lr, payload the scaled gradients; reply: payload the new values
    STATE = 5  # reply: meta {step, keys}, payload the tensors (checkpoints)
    UPDATES = 6  # reply: value = the optimizer's step count
    LOAD = 7  # round = the step count, meta {keys}, payload the tensors; reply: ack
    FINISH = 8  # this worker is done; no reply
    REPLY = 9  # a server's answer
    TICKET = 10  # async, to server 0: reply value = the ticket (this update's place), meta {staleness}


@dataclass(frozen=True)
class Header:
    kind: Kind
    worker: int = -1  # the sending worker (-1: a server)
    round: int = 0  # sync: the step's round; LOAD: the optimizer's step count
    lr: float = 0.0
    factor: float = 1.0  # the clip factor
    value: float = 0.0  # a reply's number
    meta_bytes: int = 0
    payload: int = 0  # fp32 elements

    def tensor(self) -> torch.Tensor:
        return torch.tensor([float(x) for x in astuple(self)], dtype=torch.float64)

    @classmethod
    def parse(cls, t: torch.Tensor) -> Header:
        """The header in ``t``, checked: a known kind, whole numbers where counts go, sizes in bounds."""
        kind, worker, round_, lr, factor, value, meta_bytes, payload = t.tolist()
        if not all(math.isfinite(x) for x in (kind, worker, round_, meta_bytes, payload)):
            raise ProtocolError(f"a header with a non-finite field: {t.tolist()}")
        if any(x != int(x) for x in (kind, worker, round_, meta_bytes, payload)):
            raise ProtocolError(f"a header with a fractional count: {t.tolist()}")
        if int(kind) not in {k.value for k in Kind}:
            raise ProtocolError(f"unknown message kind {int(kind)}")
        if not (0 <= meta_bytes <= MAX_META_BYTES and 0 <= payload <= MAX_PAYLOAD):
            raise ProtocolError(f"a body out of bounds: {meta_bytes:.0f} meta bytes, {payload:.0f} elements")
        counts = int(worker), int(round_)
        return cls(Kind(int(kind)), *counts, lr, factor, value, int(meta_bytes), int(payload))


Outgoing = list[tuple[dist.Work, torch.Tensor]]  # sends in flight, with the tensors they read


def send(group: dist.ProcessGroup, dst: int, header: Header, meta: dict | None = None,
         payload: torch.Tensor | None = None, *, reply: bool = False) -> Outgoing:
    """Start sending one message (header, then meta, then payload); the caller waits for the sends."""
    body = _encode(meta) if meta is not None else None
    header = replace(header, meta_bytes=0 if body is None else body.numel(),
                     payload=0 if payload is None else payload.numel())
    head_tag, body_tag = (REPLY_TAG, REPLY_BODY_TAG) if reply else (REQUEST_TAG, BODY_TAG)
    parts = [(header.tensor(), head_tag)]
    parts += [(t, body_tag) for t in (body, payload) if t is not None and t.numel()]
    return [(group.send([t], dst, tag), t) for t, tag in parts]


def wait_sent(outgoing: Outgoing, timeout_s: float) -> None:
    for work, _ in outgoing:
        work.wait(_delta(timeout_s))


def post_header(group: dist.ProcessGroup, src: int | None, *, reply: bool) -> tuple[dist.Work, torch.Tensor]:
    """Post the receive of a header from ``src`` (None: from any rank of the group)."""
    buf = torch.zeros(HEADER_LEN, dtype=torch.float64)
    tag = REPLY_TAG if reply else REQUEST_TAG
    work = group.recv_anysource([buf], tag) if src is None else group.recv([buf], src, tag)
    return work, buf


def take_header(posted: tuple[dist.Work, torch.Tensor], timeout_s: float) -> tuple[Header, int]:
    """Wait for a posted header; the checked header and the rank it came from."""
    work, buf = posted
    work.wait(_delta(timeout_s))
    return Header.parse(buf), work._source_rank()


def receive_meta(group: dist.ProcessGroup, src: int, header: Header, timeout_s: float, *,
                 reply: bool) -> dict:
    """The JSON object announced by ``header`` ({} when it announces none)."""
    if not header.meta_bytes:
        return {}
    buf = _receive(group, src, torch.empty(header.meta_bytes, dtype=torch.uint8), timeout_s, reply)
    try:
        meta = json.loads(bytes(buf.numpy()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"a message's meta is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ProtocolError("a message's meta is not a JSON object")
    return meta


def receive_payload(group: dist.ProcessGroup, src: int, header: Header, expected: int, timeout_s: float, *,
                    reply: bool) -> torch.Tensor:
    """The fp32 payload announced by ``header``, which must hold exactly ``expected`` elements."""
    if header.payload != expected:
        raise ProtocolError(f"a {header.kind.name} message of {header.payload} elements, expected {expected}")
    if not expected:
        return torch.empty(0)
    return _receive(group, src, torch.empty(expected, dtype=torch.float32), timeout_s, reply)


def _receive(group: dist.ProcessGroup, src: int, buf: torch.Tensor, timeout_s: float,
             reply: bool) -> torch.Tensor:
    group.recv([buf], src, REPLY_BODY_TAG if reply else BODY_TAG).wait(_delta(timeout_s))
    return buf


def strings(x: object) -> bool:
    """Is ``x`` (parsed JSON) a list of strings?"""
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _encode(meta: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# -- tensors <-> one flat fp32 payload, in an order both sides know ------------------------------------


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    if not shapes:  # a server that holds nothing (more servers than tensors)
        return []
    sizes = [math.prod(s) for s in shapes]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]
