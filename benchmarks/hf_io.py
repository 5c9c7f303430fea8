"""Hugging Face import / export of a large model: wall time and peak RSS of each phase.

    .venv/bin/python benchmarks/hf_io.py --workdir /tmp/hf_io --json

Phases, each in its own fresh process (so each peak RSS is that phase's alone):

1. ``make``: a random Llama of the ``--preset`` shape (default llama-1b: 1.24 B parameters, tied
   embeddings, vocab 128256) written as a Hugging Face folder the way hub checkpoints come (bf16,
   shards of ``--shard-gb``, an index, a tokenizer.json), with paratrain's own streamed writer.
2. ``import``: ``load_pretrained`` (open, check every shape from the headers, build the model,
   read every tensor with safetensors' ``get_slice`` and permute q/k to paratrain's RoPE layout),
   then the imported weights are written as a run folder (``model.safetensors`` in fp32, run.json),
   timed separately.
3. ``export``: ``paratrain export RUN --hf DIR`` (streamed, sharded, fp32).

Peak RSS comes from ``getrusage`` (ru_maxrss) of the phase's process, which includes the ~0.3 GB
of an imported torch. The model itself is 4.96 GB in fp32: import must hold it (it builds the
model); export should hold about one tensor (the 128256 x 2048 embedding: 1.05 GB in fp32).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def phase_make(work: Path, preset: str, shard_gb: float) -> dict:
    import torch

    from paratrain.models.families.llama import preset as get_preset
    from paratrain.models.families.llama.hf import (
        Entry,
        expected_shapes,
        hf_name,
        to_hf_config,
        write_sharded,
    )
    from paratrain.train.data import train_tokenizer

    cfg = get_preset(preset)
    folder = work / "source"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def random(shape):
        return lambda: torch.empty(shape).normal_(0.0, 0.02)

    entries = [Entry(hf_name(n)[0], torch.bfloat16, s, random(s)) for n, s in expected_shapes(cfg).items()]
    write_sharded(folder, entries, int(shard_gb * 2**30))
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, dtype="bfloat16")))
    train_tokenizer(["def f(x):\n    return x\n"] * 4, 300).save(str(folder / "tokenizer.json"))
    return {"n_params": cfg.n_params(), "seconds": time.perf_counter() - t0,
            "files": len(list(folder.glob("*.safetensors")))}


def phase_import(work: Path) -> dict:
    from paratrain.models.families.llama.hf import Entry, load_pretrained, write_safetensors

    t0 = time.perf_counter()
    model, ckpt = load_pretrained(str(work / "source"))
    seconds = time.perf_counter() - t0
    rss = peak_rss_bytes()
    run = work / "run"
    run.mkdir(exist_ok=True)
    t1 = time.perf_counter()
    params = list(model.named_parameters())
    write_safetensors(run / "model.safetensors",
                      [Entry(n, p.dtype, tuple(p.shape), (lambda p=p: p.detach())) for n, p in params])
    (run / "run.json").write_text(json.dumps({"task": "lm", "model": model.cfg.to_dict(),
                                              "hf": {"config": ckpt.hf_config}}))
    (run / "tokenizer.json").write_bytes(ckpt.tokenizer_path.read_bytes())
    return {"seconds": seconds, "peak_rss_bytes": rss, "write_run_seconds": time.perf_counter() - t1,
            "model_fp32_bytes": sum(p.numel() * 4 for _, p in params)}


def phase_export(work: Path, shard_gb: float) -> dict:
    from paratrain.models.families.llama.hf import export_run

    t0 = time.perf_counter()
    files = export_run(str(work / "run"), str(work / "export"), max_shard_bytes=int(shard_gb * 2**30))
    return {"seconds": time.perf_counter() - t0, "peak_rss_bytes": peak_rss_bytes(), "files": len(files)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    args = p.parse_args()
    work = Path(args.workdir)
    if args.phase:
        fn = {"make": lambda: phase_make(work, args.preset, args.shard_gb),
              "import": lambda: phase_import(work),
              "export": lambda: phase_export(work, args.shard_gb)}[args.phase]
        print(json.dumps(fn()))
        return 0
    result = {"preset": args.preset}
    for phase in ("make", "import", "export"):
        out = subprocess.run([sys.executable, __file__, "--workdir", str(work), "--preset", args.preset,
                              "--shard-gb", str(args.shard_gb), "--phase", phase],
                             capture_output=True, text=True, check=True)
        result[phase] = json.loads(out.stdout.strip().splitlines()[-1])
        if not args.json:
            print(phase, result[phase], flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
