"""What rank 0 shows while training: a progress bar in a terminal, plain lines elsewhere.

A bar redraws one line with carriage returns: in a file or a scheduler's log (``--no-progress``,
or stderr not a terminal) that is one endless line, or nothing until the end. There, a plain line
every ``--log-every`` steps (default: every 10 % of the steps) and at least every LOG_SECONDS,
flushed at once, says how far the run is, its loss and speed, and when it will end.
"""

from __future__ import annotations

import sys
import threading
import time

from paratrain.config import Config

LOG_SECONDS = 30.0  # the longest a plain log stays silent while steps finish


class Progress:
    """One call per finished step (``step(row)``) and ``close()`` at the end."""

    def step(self, row: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Bar(Progress):
    """tqdm's bar, the row's figures after it."""

    def __init__(self, cfg: Config, start: int):
        from tqdm import tqdm

        # One rank draws the bar: a thread lock is enough. tqdm's default lock includes a
        # multiprocessing semaphore, which a spawned worker (the last pipeline stage draws the bar)
        # leaves for the resource tracker to report as leaked at exit.
        tqdm.set_lock(threading.RLock())
        self.bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def step(self, row: dict) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(postfix(row))

    def close(self) -> None:
        self.bar.close()


class PlainLog(Progress):
    """``step 15/150 (10%): loss 5.123, 1,234 tok/s, ... | 0:00:42 elapsed, eta 0:06:18`` on stdout,
    for the first step, every ``every`` steps, the last one, and whenever LOG_SECONDS passed."""

    def __init__(self, cfg: Config, start: int, *, clock=time.monotonic):
        self.total, self.start = cfg.train.steps, start
        self.every = cfg.train.log_every or max(1, cfg.train.steps // 10)
        self.clock = clock
        self.began = self.last = clock()

    def step(self, row: dict) -> None:
        done, now = row["step"], self.clock()
        due = (done == self.start + 1 or done % self.every == 0 or done == self.total
               or now - self.last >= LOG_SECONDS)
        if not due:
            return
        self.last = now
        elapsed = now - self.began
        eta = elapsed / (done - self.start) * (self.total - done)
        print(f"step {done}/{self.total} ({done / self.total:.0%}): {postfix(row)} | "
              f"{_clock(elapsed)} elapsed, eta {_clock(eta)}", flush=True)


def progress(cfg: Config, start: int) -> Progress:
    """A bar where a person watches a terminal; plain lines for files, pipes and schedulers."""
    if cfg.train.progress and sys.stderr.isatty():
        return Bar(cfg, start)
    return PlainLog(cfg, start)


def postfix(row: dict) -> str:
    parts = [f"loss {row['loss']:.3f}" if row.get("loss") is not None else "loss skip",
             f"{row['tokens_per_s']:,.0f} tok/s"]
    if row.get("mfu") is not None:
        parts.append(f"mfu {row['mfu']:.0%}")
    parts.append(f"mem {row['mem_peak_bytes'] / 2**20:,.0f} MiB")
    if row.get("val_loss") is not None:
        parts.append(f"val {row['val_loss']:.3f}")
    return ", ".join(parts)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
