"""Checkpoints: sharded, reshardable, written atomically, resumable exactly.

A checkpoint is a folder ``OUT/checkpoints/step_000120/`` with

* ``rank_00000.safetensors`` ...: each rank's pieces of full tensors (shards.py): its
  parameter slices, its optimizer-state slices (ZeRO: 1-D ranges), under any state key. A tensor
  held by several ranks (dp replicas, tp-replicated norms) is written once, by one of its holders,
  chosen to balance the bytes per file;
* ``index.json``: every full tensor (single-device name, full shape, dtype) per state key, mapped
  to its pieces (file, entry, slab, flat range), plus every file's size;
* ``rng.pt``: every rank's RNG states, as tensors and numbers (engine/rng.py): it is read with
  ``torch.load(weights_only=True)``, so loading a checkpoint runs no code. An older or crafted
  ``rng.pt`` that needs a full unpickling is refused unless the user trusts it (safeload.py);
* ``state.json``: the trainer's meta (a free dict: step, layout, config, scaler, data cursor...),
  the optimizer step count and this run's id. Written last.

An optimizer whose state is not parameter-shaped (8-bit AdamW's codes and per-block scales) writes
it as 1-D full tensors in the single-process order (optim/adamw8bit.py), pieces being flat ranges.

Loading under any layout reads, on each rank, only the pieces that overlap what that rank holds.

Atomicity: every rank writes into ``step_000120.tmp-<run id>/``; once every rank reports its file
complete, global rank 0 writes the index and state, renames the folder into place, then replaces
``latest`` with ``os.replace``. A crash, Ctrl-C or a full disk at any moment leaves the previous
checkpoint and ``latest`` intact (a failed save removes its tmp folder and says why).

Background saves (``async_save``): the pieces are copied to host memory at the save point (the only
stall), written by a thread while training continues; the commit (the collective "is every rank
done?" and the rename) happens at the next save or at the end of the run, which first wait for it.

Pruning keeps this run's ``keep`` newest complete checkpoints: it only removes folders whose
``state.json`` carries this run's id, never the newest one, never anything else.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

import torch

from paratrain.comm import collectives as C
from paratrain.safeload import load_data, member, to_data_bytes
from paratrain.shards import (
    TORCH_DTYPES,
    CheckpointError,
    Piece,
    PieceSpec,
    ShardReader,
    check_coverage,
    check_sizes,
    spec_dict,
    write_safetensors,
)

__all__ = ["CheckpointError", "Saver", "checkpoint_dir", "export_safetensors", "find_checkpoint", "latest",
           "open_reader", "read_state"]

KEEP = 2
STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# --------------------------------------------------------------------------------------------
# Saving (every rank)
# --------------------------------------------------------------------------------------------


def assign_writers(all_specs: list[list[PieceSpec]]) -> dict[PieceSpec, int]:
    """Each distinct piece to one of the ranks holding it: buffers to the first holder (rank 0's
    statistics, as one process would have them); the rest largest first to the holder with the
    fewest bytes so far, so no file holds most of the checkpoint."""
    holders: dict[PieceSpec, list[int]] = {}
    for rank, specs in enumerate(all_specs):
        for s in specs:
            holders.setdefault(s, []).append(rank)
    load = [0] * len(all_specs)
    owner = {}
    for s in sorted(holders, key=lambda s: (s.key != "buffer", -s.nbytes, s.entry)):
        r = holders[s][0] if s.key == "buffer" else min(holders[s], key=lambda r: (load[r], r))
        owner[s] = r
        load[r] += s.nbytes
    return owner


def write_pieces(path: Path, pieces: list[Piece]) -> int:
    entries = [(p.spec.entry, (p.spec.hi - p.spec.lo,), TORCH_DTYPES[p.spec.dtype]) for p in pieces]
    return write_safetensors(path, entries, lambda i: pieces[i].value())


class _Pending:
    def __init__(self, step: int, tmp: Path, owner: dict, meta: dict, rngs: list | None, files: dict):
        self.step, self.tmp, self.owner, self.meta, self.rngs = step, tmp, owner, meta, rngs
        self.files = files
        self.error: str | None = None
        self.size = 0
        self.thread: threading.Thread | None = None


class Saver:
    """One per rank. ``save`` at each save point, ``finish`` at the end of the run."""

    def __init__(self, out: str | Path, mesh, *, keep: int = KEEP, async_save: bool = False):
        if keep < 1:
            raise CheckpointError(f"keep_checkpoints must be >= 1 (got {keep}): the newest is never removed")
        self.root, self.mesh, self.keep, self.async_save = checkpoint_dir(out), mesh, keep, async_save
        self.run_id: str | None = None  # inherited on resume; otherwise chosen by rank 0 at the first save
        self.pending: _Pending | None = None
        self.last: Path | None = None  # the newest checkpoint this saver committed
        self.stall_s: list[float] = []  # seconds each save held the training loop (measured by the trainer)

    @property
    def world(self) -> C.Axis:
        return self.mesh.world

    def save(self, step: int, pieces: list[Piece], meta: dict, rng_state: dict,
             files: dict[str, bytes] | None = None) -> None:
        """Write this rank's pieces of checkpoint ``step`` (collective: every rank calls it).
        ``files`` (rank 0's): more files of the checkpoint, committed with it (the library's
        optimizer settings and registered objects)."""
        self.finish()
        rank = self.world.rank
        with self.mesh.counter.paused():  # bookkeeping, not training traffic
            if self.run_id is None:
                self.run_id = C.all_gather_object(uuid.uuid4().hex[:12], self.world)[0]
            all_specs = C.all_gather_object([p.spec for p in pieces], self.world)
            rngs = C.gather_object(rng_state, self.world)
        owner = assign_writers(all_specs)
        mine = list({p.spec: p for p in pieces if owner[p.spec] == rank}.values())
        tmp = self.root / f"step_{step:06d}.tmp-{self.run_id}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        C.barrier(self.world)
        job = _Pending(step, tmp, owner, meta, rngs, files or {})
        if self.async_save:  # snapshot now (host copies), write in the background
            mine = [Piece(p.spec, p.value().detach().to("cpu", copy=True)) for p in mine]
            job.thread = threading.Thread(target=self._write, args=(job, mine), daemon=True)
            job.thread.start()
        else:
            self._write(job, mine)
        self.pending = job
        if not self.async_save:
            self.finish()

    def check_free(self, steps: list[int]) -> None:
        """Refuse, before training, to end up replacing a folder this run did not write (a fresh
        run into an OUT that holds another run's checkpoints at the steps it will save)."""
        taken = [f.name for f in (self.root / f"step_{s:06d}" for s in steps)
                 if f.exists() and (self.run_id is None or _run_of(f) != self.run_id)]
        if taken:
            raise CheckpointError(f"{self.root} already holds {', '.join(taken)} from another run: continue "
                                  "that run with --resume, or use another --out (or remove those folders)")

    def _write(self, job: _Pending, mine: list[Piece]) -> None:
        path = job.tmp / rank_file(self.world.rank)
        try:
            job.size = write_pieces(path, mine)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        except OSError as e:
            job.error = f"{type(e).__name__}: {e} (writing {path})"
            path.unlink(missing_ok=True)

    def abandon(self) -> None:
        """After a failure elsewhere: wait for our writer thread; the uncommitted folder is removed
        by the next save of this run."""
        if self.pending is not None and self.pending.thread is not None:
            self.pending.thread.join()
        self.pending = None

    def finish(self) -> Path | None:
        """Wait for the pending save, then commit it (collective). Returns the committed folder."""
        job, self.pending = self.pending, None
        if job is None:
            return self.last
        if job.thread is not None:
            job.thread.join()
        with self.mesh.counter.paused():
            status = C.all_gather_object((job.error, job.size), self.world)
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(status) if e]
        if not errors and self.world.rank == 0:
            try:
                self._commit(job, [size for _, size in status])
            except OSError as e:
                errors.append(f"rank 0: {type(e).__name__}: {e} (committing {job.tmp})")
        with self.mesh.counter.paused():
            errors = C.all_gather_object(errors, self.world)[0]
        if errors:
            if self.world.rank == 0:
                shutil.rmtree(job.tmp, ignore_errors=True)
            previous = f"the previous checkpoint {self.last or 'under ' + str(self.root)} is intact" \
                if self.last or latest_name(self.root) else "no earlier checkpoint exists"
            hint = " (the disk is full: free space or point --out elsewhere)" \
                if any(os.strerror(errno.ENOSPC) in e for e in errors) else ""
            raise CheckpointError(f"saving checkpoint step {job.step} failed{hint}: {'; '.join(errors)}. "
                                  f"Nothing of it was kept; {previous}.")
        self.last = self.root / f"step_{job.step:06d}"
        return self.last

    def _commit(self, job: _Pending, sizes: list[int]) -> None:
        """Rank 0: index + rng + state (last), fsync, rename into place, point ``latest``, prune."""
        tensors: dict[str, dict] = {}
        for spec, r in job.owner.items():
            rec = tensors.setdefault(spec.name, {}).setdefault(
                spec.key, {"shape": list(spec.full_shape), "dtype": spec.dtype, "pieces": []})
            rec["pieces"].append(spec_dict(spec, rank_file(r)))
        files = {rank_file(r): size for r, size in enumerate(sizes)}
        index = {"format": "paratrain-sharded/1", "world_size": len(sizes), "files": files,
                 "tensors": tensors}
        _write_synced(job.tmp / "index.json", json.dumps(index).encode())
        _write_synced(job.tmp / "rng.pt", to_data_bytes(job.rngs, "the RNG states"))
        for name, data in job.files.items():
            _write_synced(job.tmp / name, data)
        state = {**job.meta, "step": job.step, "run_id": self.run_id, "world_size": len(sizes)}
        _write_synced(job.tmp / "state.json", json.dumps(state, indent=2).encode())
        final = self.root / f"step_{job.step:06d}"
        if final.exists():  # an earlier attempt of this run at the same step; never anyone else's
            if _run_of(final) != self.run_id:
                raise OSError(errno.EEXIST, f"{final} exists and was not written by this run; use another "
                              "--out, or --resume that run")
            shutil.rmtree(final)
        os.replace(job.tmp, final)
        _write_pointer(self.root, final.name)
        prune(self.root, self.keep, self.run_id, newest=final)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_pointer(root: Path, name: str) -> None:
    tmp = root / f"latest.tmp-{os.getpid()}"
    _write_synced(tmp, (name + "\n").encode())
    os.replace(tmp, root / "latest")


def _run_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / "state.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def prune(root: Path, keep: int, run_id: str, newest: Path) -> list[Path]:
    """Remove this run's complete checkpoints beyond the ``keep`` newest (by step), and this run's
    own stale tmp folders. Folders of other runs, or that are not checkpoints, are never touched."""
    ours = []
    for f in root.iterdir():
        m = STEP_DIR.fullmatch(f.name)
        if m and f.is_dir() and _run_of(f) == run_id:
            ours.append((int(m.group(1)), f))
    removed = [f for _, f in sorted(ours)[:-keep] if f != newest]
    removed += [f for f in root.glob(f"step_*.tmp-{run_id}") if f.is_dir()]
    for f in removed:
        shutil.rmtree(f, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------------------------
# Finding and checking a checkpoint to resume from
# --------------------------------------------------------------------------------------------


def latest_name(root: Path) -> str | None:
    """What ``latest`` names, when it names a checkpoint folder; None otherwise."""
    try:
        text = (root / "latest").read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if STEP_DIR.fullmatch(text) else None


def problems_of(folder: Path) -> list[str]:
    """Why ``folder`` cannot be resumed from (empty: it can)."""
    state = folder / "state.json"
    if not state.exists():
        return [f"{state} is missing (the save did not complete)"]
    try:
        if not isinstance(json.loads(state.read_text()).get("step"), int):
            return [f"{state} has no step number"]
    except (ValueError, UnicodeDecodeError, AttributeError):
        return [f"{state} is not valid JSON (corrupted)"]
    index_path = folder / "index.json"
    try:
        tensors, files, problems = index_problems(folder)
    except CheckpointError as e:
        return [str(e)]
    for name, size in files.items():
        try:
            path = member(folder, name, str(index_path), CheckpointError)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if not path.exists():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{path} is {path.stat().st_size} bytes where index.json says {size} "
                            "(truncated?)")
    if not (folder / "rng.pt").exists():
        problems.append(f"{folder / 'rng.pt'} is missing")
    return problems


def index_problems(folder: Path) -> tuple[dict, dict, list[str]]:
    """(tensors, files, problems) of ``folder``'s index.json: pieces that do not cover their tensor,
    or shapes larger than the files hold (checked before anything is allocated for them).
    CheckpointError when the index is missing or not one."""
    index_path = folder / "index.json"
    try:
        index = json.loads(index_path.read_text())
        tensors, files = index["tensors"], index["files"]
        problems = check_coverage(tensors)[:3] + check_sizes(tensors, files)[:3]
    except FileNotFoundError:
        raise CheckpointError(f"{index_path} is missing") from None
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index_path} is not a valid checkpoint index (corrupted)") from None
    return tensors, files, [f"{index_path}: {p}" for p in problems]


def find_checkpoint(out: str | Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and notes on what was skipped and why.

    ``latest`` first, then every other ``step_N`` folder, newest first; the first without problems
    wins. None only when there is no checkpoint at all; when there are some but none is usable,
    CheckpointError (never a silent restart from step 0)."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return None, []
    notes = []
    pointed = latest_name(root)
    if (root / "latest").exists() and pointed is None:
        notes.append(f"{root / 'latest'} does not name a checkpoint (garbage): ignoring it")
    folders = sorted((f for f in root.iterdir() if STEP_DIR.fullmatch(f.name) and f.is_dir()),
                     key=lambda f: -int(STEP_DIR.fullmatch(f.name).group(1)))
    order = ([root / pointed] if pointed else []) + [f for f in folders if f.name != pointed]
    for f in order:
        problems = problems_of(f) if f.is_dir() else [f"{f} (named by latest) does not exist"]
        if not problems:
            if notes:
                notes.append(f"resuming from {f} instead")
            return f, notes
        notes.append(f"skipping {f.name}: {'; '.join(problems)}")
    if order or notes:
        raise CheckpointError(f"no usable checkpoint under {root}: " + " | ".join(notes)
                              + ". Restore or remove the damaged files, or start afresh without --resume "
                              "(or with another --out)")
    return None, notes


def latest(out: str | Path) -> Path | None:
    """The newest usable checkpoint folder, or None."""
    try:
        return find_checkpoint(out)[0]
    except CheckpointError:
        return None


def read_state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())


def read_rng(folder: Path, *, trust: bool = False) -> list:
    """Every rank's RNG states (engine/rng.py), loaded as plain data; an older checkpoint's pickle
    only when ``trust`` (the user's --trust-checkpoint), with a warning."""
    path = folder / "rng.pt"
    rngs = load_data(path, CheckpointError, trust=trust)
    if not isinstance(rngs, list) or not all(isinstance(r, dict) and "cpu" in r for r in rngs):
        raise CheckpointError(f"{path} does not hold RNG states (a list of one state per rank): the file is "
                              "damaged or not paratrain's")
    return rngs


def open_reader(folder: Path) -> ShardReader:
    """The reader of ``folder``'s pieces, once its index passes ``index_problems`` (CheckpointError)."""
    meta = read_state(folder) if (folder / "state.json").exists() else {}
    tensors, _, problems = index_problems(folder)
    if problems:
        raise CheckpointError("; ".join(problems))
    return ShardReader(folder, tensors, meta)


# --------------------------------------------------------------------------------------------
# Export: full tensors, streamed one at a time
# --------------------------------------------------------------------------------------------


def export_safetensors(folder: Path, path: str | Path) -> Path:
    """The model (parameters + buffers, full, single-device names) of a checkpoint as one
    safetensors file, assembled and written one tensor at a time."""
    reader = open_reader(folder)
    items = [(name, key, tuple(rec["shape"]), TORCH_DTYPES[rec["dtype"]])
             for name, keys in reader.tensors.items() for key, rec in keys.items()
             if key in ("param", "buffer")]

    def produce(i: int) -> torch.Tensor:
        name, key, shape, _ = items[i]
        slab = shape or (1,)
        return reader.read(name, key, (0,) * len(slab), slab).view(shape)

    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        write_safetensors(tmp, [(n, s, d) for n, _, s, d in items], produce)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        reader.close()
    return path
