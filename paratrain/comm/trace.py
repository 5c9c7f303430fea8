"""Which collective each rank was in: fingerprints, a ring buffer, and the diagnosis of a divergence.

Ranks of a group must issue the same collectives in the same order. When one skips or reorders
one (a branch taken on one rank only), the others wait in a collective it never joins, or worse,
pair it with a different one of the same size. A timeout then says only "timed out". Here every
collective gets a sequence number *per group* and a fingerprint (kind, group, shape, dtype, a
purpose such as "all-gather of unit layers.1", and the optimizer step the rank is at); each rank
keeps its recent ones; and when the run fails, the ranks' histories are compared to say where they
parted and what each was doing:

    ranks diverged on group dp[0, 1] at collective #41: rank 1 skipped all-gather of unit layers.1
    (rank 0 waited there; rank 1 went on to all-gather of unit layers.2)

The step is what tells apart two steps whose collectives look alike: a rank of a user's loop that
skips one backward but still steps pairs its next backward's gradient buckets with the others'
previous ones, collective for collective, same kind, shape and purpose; only the step differs, so
the checker fails there, naming both ranks and their steps (issue 35).

The buffer is per process, like the process's stack: a collective's sequence is a fact about the
process, whichever mesh issued it (tests run several trainers in one worker; their collectives
stay in step on every rank). Workers started by paratrain's launcher mirror it into a memory-mapped
file the launcher reads after a failure: a rank that dies in native code (gloo aborts the process
when the sizes of a mismatched pair differ) leaves its history all the same.
"""

from __future__ import annotations

import json
import mmap
import zlib
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

HISTORY = 256  # fingerprints kept per rank: a few steps of the tiny model, the last moments of a big one
SLOT = 256  # bytes per fingerprint in the mirror file (JSON, zero-padded)


@dataclass(frozen=True)
class Fingerprint:
    seq: int  # this collective's number within its group, from 1
    kind: str  # all_reduce, all_gather, ...
    group: str  # axis name and global ranks, e.g. "dp[0, 1]"
    shape: tuple | None  # what every member passes (None where members legitimately differ)
    dtype: str
    what: str | None  # the purpose, at the call sites that matter
    step: int = 0  # the optimizer steps this rank had taken (CommCounter.step)

    def describe(self) -> str:
        shape = "" if self.shape is None else list(self.shape)
        what = self.what or self.kind.replace("_", "-")
        return f"{what} ({self.kind} {self.dtype}{shape}) at step {self.step}"

    @property
    def op(self) -> tuple:
        return self.kind, self.shape, self.dtype, self.what, self.step

    def same_op(self, other: Fingerprint) -> bool:
        return self.op == other.op

    def digest(self) -> int:
        """A number equal on every member for the same collective (what the checker compares)."""
        key = f"{self.seq}|{self.kind}|{self.group}|{self.shape}|{self.dtype}|{self.what}|{self.step}"
        return zlib.crc32(key.encode())


class Trace:
    def __init__(self, size: int = HISTORY):
        self.seq: Counter = Counter()
        self.recent: deque[Fingerprint] = deque(maxlen=size)
        self.size, self.written, self.mirror = size, 0, None
        self._encoded: dict[tuple, bytes] = {}

    def next(self, kind: str, group: str, shape: Iterable[int] | None, dtype: object,
             what: str | None, step: int = 0) -> Fingerprint:
        self.seq[group] += 1
        fp = Fingerprint(self.seq[group], kind, group, None if shape is None else tuple(shape),
                         str(dtype).removeprefix("torch."), what, step)
        self.recent.append(fp)
        if self.mirror is not None:
            self._write(fp)
        return fp

    def attach(self, path: str) -> None:
        """Mirror every fingerprint into ``path`` (8-byte count, then a ring of SLOT-byte records)."""
        with open(path, "wb+") as f:
            f.truncate(8 + self.size * SLOT)
            self.mirror = mmap.mmap(f.fileno(), 8 + self.size * SLOT)

    def _write(self, fp: Fingerprint) -> None:
        # The same few collectives repeat every step: encode each once, only the numbers change.
        key = (fp.group, fp.kind, fp.shape, fp.dtype, fp.what)
        rest = self._encoded.get(key)
        if rest is None:
            rest = json.dumps([fp.kind, fp.group, fp.shape, fp.dtype, (fp.what or "")[:120] or None])[1:]
            rest = self._encoded[key] = rest.encode()
        at = 8 + (self.written % self.size) * SLOT
        self.mirror[at:at + SLOT] = (b"[%d,%d," % (fp.seq, fp.step) + rest)[:SLOT].ljust(SLOT, b"\0")
        self.written += 1
        self.mirror[0:8] = self.written.to_bytes(8, "little")

    def history(self) -> list[Fingerprint]:
        return list(self.recent)


TRACE = Trace()


def read_mirror(path: str) -> list[Fingerprint]:
    """The fingerprints a (possibly dead) process mirrored into ``path``, oldest first."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if len(data) < 8:
        return []
    written, size = int.from_bytes(data[:8], "little"), (len(data) - 8) // SLOT
    out = []
    for n in range(max(0, written - size), written):
        at = 8 + (n % size) * SLOT
        try:
            seq, step, kind, group, shape, dtype, what = json.loads(data[at:at + SLOT].rstrip(b"\0"))
        except ValueError:  # the record being written when the process died
            continue
        out.append(Fingerprint(seq, kind, group, None if shape is None else tuple(shape), dtype, what, step))
    return out

# ------------------------------------------------------------------------------------------------
# Diagnosis: histories of several ranks -> one message
# ------------------------------------------------------------------------------------------------

def diagnose(histories: dict[int, list[Fingerprint]]) -> str | None:
    """Where the ranks' collective sequences first differ, per group; None if they agree."""
    lines = []
    groups = sorted({fp.group for h in histories.values() for fp in h})
    for group in groups:
        per_rank = {r: {fp.seq: fp for fp in h if fp.group == group} for r, h in histories.items()}
        per_rank = {r: seqs for r, seqs in per_rank.items() if seqs}
        if len(per_rank) > 1:
            line = _first_difference(group, per_rank)
            if line:
                lines.append(line)
    return "\n".join(lines) or None


def _first_difference(group: str, per_rank: dict[int, dict[int, Fingerprint]]) -> str | None:
    found = _first_divergence(per_rank)
    if found is None:
        return None
    seq, at = found
    return f"ranks diverged on group {group} at collective #{seq}: " + _explain(seq, at, per_rank)


def _first_divergence(per_rank: dict[int, dict[int, Fingerprint]]) -> tuple[int, dict] | None:
    """The first collective number where the ranks' histories differ, and each rank's entry there."""
    start = max(min(seqs) for seqs in per_rank.values())  # the window every rank still remembers
    end = max(max(seqs) for seqs in per_rank.values())
    for seq in range(start, end + 1):
        at = {r: seqs.get(seq) for r, seqs in per_rank.items()}
        ops = {r: fp for r, fp in at.items() if fp is not None}
        if len(ops) == len(at) and all(fp.same_op(next(iter(ops.values()))) for fp in ops.values()):
            continue
        return seq, at
    return None


def stragglers(histories: dict[int, list[Fingerprint]]) -> list[int]:
    """Ranks that never reached a collective their group's other ranks were at (hung or stuck outside
    the collectives): the cause of a timeout, where the ranks that report it are only waiting."""
    late: set[int] = set()
    for group in sorted({fp.group for h in histories.values() for fp in h}):
        per_rank = {r: {fp.seq: fp for fp in h if fp.group == group} for r, h in histories.items()}
        per_rank = {r: seqs for r, seqs in per_rank.items() if seqs}
        found = _first_divergence(per_rank) if len(per_rank) > 1 else None
        if found:
            late |= {r for r, fp in found[1].items() if fp is None}
    return sorted(late)


def _explain(seq: int, at: dict, per_rank: dict) -> str:
    """A rank whose #seq is another rank's #seq+1 is ahead: it skipped what the others are at.
    Otherwise a strict majority names the odd ones out; with two ranks each is described."""
    def ahead(r: int, fp: Fingerprint) -> bool:
        return any(q != r and (o := seqs.get(seq + 1)) is not None and o.same_op(fp)
                   for q, seqs in per_rank.items())

    skippers = {r for r, fp in at.items() if fp is not None and ahead(r, fp)}
    votes = Counter(fp.describe() for r, fp in at.items() if fp is not None and r not in skippers)
    expected, n = votes.most_common(1)[0] if votes else ("?", 0)
    parts = []
    for r, fp in sorted(at.items()):
        if fp is None:
            last = per_rank[r][max(per_rank[r])]
            parts.append(f"rank {r} never reached it (its last was #{last.seq} {last.describe()})")
        elif r in skippers:
            parts.append(f"rank {r} skipped {expected} and went on to {fp.describe()}")
        elif n > len(at) / 2 and fp.describe() != expected:
            parts.append(f"rank {r} diverged: it was at {fp.describe()} where the others were at {expected}")
        else:
            parts.append(f"rank {r} was at {fp.describe()}")
    return "; ".join(parts)
