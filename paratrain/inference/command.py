"""`paratrain generate`: prepare the prompts (inference/prompts.py), pick ONE backend by the request's
layout and write what it generated (printed, or --out FILE.jsonl).

Backends, each ``generate_ids(request, prepared) -> list[Generated]`` (rank 0's result, in prompt
order; request.sampling.eos_ids already filled): "one" (this file: the whole model in this
process), "distributed" (inference/distributed.py: --nproc/--tp/--pp or torchrun) and "stream"
(inference/stream.py: --offload cpu|disk). A backend not yet built is a clear error.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from paratrain.data.sources import DataError
from paratrain.inference.distributed import generate_ids as distributed_ids
from paratrain.inference.distributed import load_for_generation
from paratrain.inference.folders import load_model
from paratrain.inference.loop import Generated, Sampling, decode, local_step, sampling_problems
from paratrain.inference.prompts import cut_at_stop, prepare
from paratrain.inference.request import GenerateRequest, PreparedPrompts
from paratrain.inference.stream_command import generate_ids as stream_ids
from paratrain.inference.weights import open_weights

__all__ = ["GenerateRequest", "PreparedPrompts", "run_generate", "BACKENDS", "backend_name"]

Backend = Callable[[GenerateRequest, PreparedPrompts], list[Generated]]


def one_process_ids(request: GenerateRequest, prepared: PreparedPrompts) -> list[Generated]:
    """The whole model in this process, through the KV-cached decode loop."""
    whole_file = request.init_from or (Path(request.run) / "model.safetensors").exists()
    if request.checkpoint is None and whole_file:
        model = load_model(request.run, request.init_from)
    else:  # a sharded checkpoint (named, or the latest of a run stopped before its end)
        model = load_for_generation(open_weights(request.run, None, request.checkpoint), None)
    model = model.to(request.device)
    return decode(local_step(model), prepared.ids, request.sampling, request.device, prepared.stop)


# The backends by name.
BACKENDS: dict[str, Backend] = {"one": one_process_ids, "distributed": distributed_ids, "stream": stream_ids}


def backend_name(request: GenerateRequest) -> str:
    """Which backend serves the request: streaming when offloading, ranks when more than one."""
    if request.offload != "none":
        return "stream"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return "distributed" if max(request.nproc, request.tp, request.pp, world) > 1 else "one"


def run_generate(request: GenerateRequest) -> int:
    """Prepare the prompts, generate with one backend, print or write the completions. Exit status."""
    check_sampling(request)
    name = backend_name(request)
    if name not in BACKENDS:
        flags = "--offload" if name == "stream" else "--nproc/--tp/--pp (or torchrun)"
        raise DataError(f"{flags}: this build of paratrain cannot generate that way yet; drop the flag")
    prepared = prepare(request)
    request = replace(request, sampling=replace(request.sampling, eos_ids=prepared.eos_ids))
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if main_rank:  # on stderr: stdout holds the completions alone, for scripts
        print(decoding_line(request.sampling), file=sys.stderr)
    results = BACKENDS[name](request, prepared)
    if main_rank:
        write_results(request, prepared, results)
    return 0


def check_sampling(request: GenerateRequest) -> None:
    """Every sampling flag out of range, named, before a prompt is read or a weight loaded."""
    problems = sampling_problems(request.sampling)
    if problems:
        raise DataError("; ".join(f"--{name.replace('_', '-')} {why}" for name, why in problems))


def decoding_line(sampling: Sampling) -> str:
    """Which decoding the completions come from (a small model's sampled text can read as noise where
    its greedy text does not), and how to get the other one."""
    other = ("--temperature T for sampled text" if sampling.temperature <= 0
             else "--greedy for the most likely tokens")
    return f"paratrain generate: decoding {sampling.describe()} ({other})"


def rows(request: GenerateRequest, prepared: PreparedPrompts, results: list[Generated]) -> list[dict]:
    """One output object per prompt, in input order."""
    out = []
    for text, cut, result in zip(prepared.texts, prepared.truncated, results):
        completion = completion_text(prepared, request, result)
        out.append({"prompt": text, "completion": completion, "new_tokens": len(result.ids),
                    "finish": result.finish, "truncated": cut})
    return out


def completion_text(prepared: PreparedPrompts, request: GenerateRequest, result: Generated) -> str:
    """The decoded new tokens, cut before a --stop string."""
    text = prepared.tokenizer.decode(result.ids)
    return cut_at_stop(text, request.stop) if result.finish == "stop" else text


def write_results(request: GenerateRequest, prepared: PreparedPrompts, results: list[Generated]) -> None:
    """--out FILE.jsonl (written whole, then renamed), else each completion printed (one prompt:
    just its completion, as before batches)."""
    objs = rows(request, prepared, results)
    if request.out:
        path = Path(request.out)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs), encoding="utf-8")
        os.replace(tmp, path)
        return
    if len(objs) == 1:
        print(objs[0]["completion"])
        return
    for where, obj in zip(prepared.where, objs):
        print(f"--- {where} ({obj['finish']})\n{obj['completion']}")
