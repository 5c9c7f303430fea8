"""The combinations paratrain refuses, as records that docs/composition.md is generated from.

Every check that refuses two features together (engine/checks.py, memory/layout.py,
engine/lora.py, config.py, inference/library.py, ...) declares its refusal as one ``Refusal``
beside the check and emits the user's message from it (``Refusal.emit``). Declaring it registers
it: ``python -m paratrain.compose_matrix`` reads every declared refusal, and tests/test_composition.py
fails when a combination the checks refuse has no record, so a new refusal is one ``Refusal(...)``
line in its check's table and a lifted one is a deleted line (then regenerate the matrix).

This module sits in the lowest layer: it names features by the matrix's short names (``FEATURES``)
and knows nothing of the configuration it is handed (``when``/``message`` receive it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The matrix's features, in its order: short name -> what it is (the flag that turns it on).
FEATURES: dict[str, str] = {
    "ddp": "DDP, bucketed and overlapped (--dp N, the default mode)",
    "dp-plain": "plain data parallel: one all-reduce after backward (--dp-mode plain)",
    "ddp-shm": "DDP summed through shared memory on one host (--dp-reduce shm)",
    "zero1": "ZeRO-1: optimizer state sharded (--zero 1)",
    "zero2": "ZeRO-2: + gradients (--zero 2)",
    "zero3": "ZeRO-3: + parameters (--zero 3)",
    "offload-cpu": "ZeRO's optimizer partition on the CPU (--offload cpu)",
    "offload-disk": "ZeRO's optimizer partition on disk (--offload disk)",
    "act-offload": "activations offloaded to the CPU (--offload-activations cpu)",
    "hsdp": "hybrid sharding: replicas of ZeRO shard groups (--dp-replicate R)",
    "local-sgd": "parameter averaging every H steps (--sync local-sgd)",
    "diloco": "DiLoCo's outer optimizer (--sync diloco)",
    "param-server": "a parameter server (--sync parameter-server)",
    "tp": "tensor parallel (--tp N)",
    "sp": "sequence parallel inside TP (--sp)",
    "gpipe": "pipeline, GPipe schedule (--pp N --pp-schedule gpipe)",
    "1f1b": "pipeline, 1F1B schedule (--pp N, the default schedule)",
    "interleaved": "pipeline, interleaved 1F1B (--pp-schedule interleaved --virtual-stages V)",
    "zb-h1": "pipeline, zero-bubble ZB-H1 (--pp-schedule zb-h1)",
    "zbv": "pipeline, zero-bubble V (--pp-schedule zbv)",
    "dualpipev": "pipeline, DualPipeV (--pp-schedule dualpipev)",
    "cp": "context parallelism: every sequence split over the cp ranks (--cp N, ring or all-to-all)",
    "moe": "a mixture-of-experts model, experts replicated (--model tiny-moe, --experts N)",
    "ep": "expert parallel (--ep N)",
    "lora": "LoRA adapters on an fp32 base (--lora R)",
    "lora-bf16": "LoRA with the frozen base stored in bf16 (--lora R --base-precision bf16)",
    "qlora": "LoRA on a quantised frozen base: QLoRA (--lora R --base-precision nf4|int8)",
    "bf16": "bf16 mixed precision (--precision bf16)",
    "recompute": "activation recompute (--recompute selective|full)",
    "tiling": "token tiles / ZeRO-3 weight tiles (--tile N)",
    "compile": "torch.compile'd blocks (--compile)",
    "8bit": "8-bit AdamW (--optimizer adamw8bit)",
    "batch-finder": "the batch finder (--micro-batch auto)",
    "packing": "packed rows with loss masks (chat / completion data)",
    "generation": "generation from a run (paratrain generate, paratrain.generate)",
}

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
# Features that are values of one setting: the matrix pairs them with "alternatives", not a test.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("ddp", "dp-plain", "param-server"),
    ("ddp", "ddp-shm"),  # how DDP sums its buckets
    ("ddp", "zero1", "zero2", "zero3"),  # --zero 0 is DDP
    ("offload-cpu", "offload-disk"),
    ("local-sgd", "diloco", "param-server"),
    PP_SCHEDULES,
    ("lora", "lora-bf16", "qlora"),
)

_DECLARED: list[Refusal] = []


class Spelling:
    """How the user wrote a setting, so one rule speaks to both doors: the trainer's flags
    (``--zero 2``) or the library's keywords (``zero = 2``)."""

    KEYWORDS = {"sp": "sequence_parallel"}  # where the library's keyword is not the config key

    def __init__(self, *, flags: bool):
        self.flags = flags

    def __call__(self, key: str, value: object = None, *, text: str | None = None) -> str:
        """``key`` alone, with ``value`` as the user writes it, or followed by ``text`` as is."""
        shown = text if text is not None else None if value is None else (
            str(value) if self.flags else repr(value))
        if self.flags:
            flag = "--" + key.replace("_", "-")
            return flag if shown is None else f"{flag} {shown}"
        name = self.KEYWORDS.get(key, key)
        return name if shown is None else f"{name} = {shown}"


FLAGS = Spelling(flags=True)  # the trainer's words (and the matrix's)

Names = str | tuple[str, ...]


@dataclass(frozen=True)
class Refusal:
    """Two features (each a name or a tuple of names: every pair between them) the code refuses
    together, and why. ``when(cfg)`` says whether a run's configuration hits it (None: refused
    where the adapted modules or the weights are known, and the check emits ``says()`` itself);
    ``door="library"`` when ``when`` reads a ``paratrain.Parallel``; ``message`` is the user's
    line (a string or ``cfg -> str``; default ``"<first> does not compose with <second>: why"``
    from ``flags``); ``spoken`` instead, ``(cfg, say) -> str``, for a rule both doors check (engine/
    checks.py ``check_parallel_rules``): ``say`` (a ``Spelling``) writes the settings in the door's
    words."""

    first: Names
    second: Names
    reason: str
    when: Callable[[Any], bool] | None = None
    message: str | Callable[[Any], str] | None = None
    flags: tuple[str, str] = ("", "")
    spoken: Callable[[Any, Spelling], str] | None = None
    door: str = "train"  # what when/message read: "train" a run's Config, "library" a paratrain.Parallel
    where: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        unknown = [n for n in (*_names(self.first), *_names(self.second)) if n not in FEATURES]
        if unknown:
            raise ValueError(f"Refusal names unknown features {unknown}: add them to refusals.FEATURES")
        if not self.where:  # the module that declares it (the frame above the dataclass __init__)
            object.__setattr__(self, "where", sys._getframe(2).f_globals.get("__name__", ""))
        _DECLARED.append(self)

    def pairs(self) -> list[tuple[str, str]]:
        """Every (a, b) matrix cell this refusal covers."""
        return [(a, b) for a in _names(self.first) for b in _names(self.second) if a != b]

    def says(self, cfg: Any = None, say: Spelling = FLAGS) -> str:
        if self.spoken is not None:
            return self.spoken(cfg, say)
        if callable(self.message):
            return self.message(cfg)
        if self.message is not None:
            return self.message
        return f"{self.flags[0]} does not compose with {self.flags[1]}: {self.reason}"

    def hits(self, cfg: Any) -> bool:
        return self.when is not None and bool(self.when(cfg))


def emit(table: tuple[Refusal, ...] | list[Refusal], cfg: Any, problems: list[str],
         say: Spelling = FLAGS) -> None:
    """Append the message of every refusal of ``table`` that ``cfg`` hits, each message once (two
    records may share the fix, as --dp-reduce shm's do); ``say``: the door's words (``spoken``)."""
    for r in table:
        if r.hits(cfg) and r.says(cfg, say) not in problems:
            problems.append(r.says(cfg, say))


def declared() -> tuple[Refusal, ...]:
    """Every refusal declared so far (import the modules that hold the checks first)."""
    return tuple(_DECLARED)


def _names(names: Names) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)
