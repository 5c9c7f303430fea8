"""What `paratrain generate` was asked (GenerateRequest) and the prompts made ready for a backend
(PreparedPrompts): plain data every backend (one process, inference/distributed.py,
inference/stream.py) reads, kept apart from inference/command.py so a backend imports it without
importing the command that dispatches to it."""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.inference.loop import Sampling, StopCheck


@dataclass
class GenerateRequest:
    """One `paratrain generate` (or library) call. Source: ``run`` (a run folder), or ``init_from``
    (a Hugging Face folder), or ``checkpoint`` (a run's sharded checkpoint). ``sampling.eos_ids``
    is filled by run_generate from the model's folder (backends read it from here)."""

    run: str | None = None
    init_from: str | None = None
    checkpoint: str | None = None
    prompts: list[str] = field(default_factory=list)  # texts (each a user message under chat)
    prompts_file: str | None = None  # .jsonl or .txt
    chat: bool = False
    out: str | None = None  # .jsonl of results; None: print the completions
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    truncate_prompts: bool = False
    ignore_eos: bool = False
    nproc: int = 1
    tp: int = 1
    pp: int = 1
    offload: str = "none"  # none | cpu | disk
    memory_limit: int | None = None  # bytes
    offload_dir: str | None = None
    device: str = "cpu"


@dataclass
class PreparedPrompts:
    """The prompts as token ids (in input order), the texts they came from, how many tokens each lost
    to --truncate-prompts, the end-of-sequence ids, the tokenizer and the --stop check."""

    ids: list[list[int]]
    texts: list[str]
    truncated: list[int]
    eos_ids: tuple[int, ...]
    tokenizer: object  # a tokenizers.Tokenizer
    stop: StopCheck | None = None
    where: list[str] = field(default_factory=list)  # "prompts.jsonl:3" or "prompt 2", for messages
