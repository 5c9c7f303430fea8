"""`paratrain data prepare`: tokenize a corpus once into a folder that training memory-maps.

    paratrain data prepare --data corpus/ --out prepared/ [--tokenizer tok.json] [--workers 8]
    paratrain train --data prepared/ ...          # every rank maps prepared/tokens.bin
    paratrain data prepare --data chat.jsonl --tokenizer MODEL_DIR --out chat/   # + mask.bin (chat.py)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paratrain.data.chat import FORMATS
from paratrain.data.sources import DataError
from paratrain.data.tokenfile import PrepareOptions, prepare, read_manifest
from paratrain.data.tokenizer import tokenizer_file

# What `paratrain data --help` tells a user.
DESCRIPTION = """Tokenize a corpus once into a folder that training reads directly (every rank
memory-maps it).

examples:
  paratrain data prepare --data corpus/ --out prepared/ [--tokenizer tok.json] [--workers 8]
  paratrain train --data prepared/ ...
  paratrain data prepare --data chat.jsonl --tokenizer MODEL_DIR --out chat/   # + the loss mask of chats"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratrain data", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="tokenize --data into --out (tokens.bin, docs.bin, manifest.json; "
                                          "mask.bin for chat and completion data)")
    prep.add_argument("--data", help="file or folder of text, .jsonl, .parquet (default: the stdlib sources)")
    prep.add_argument("--out", required=True, help="folder to write (reused when already up to date)")
    prep.add_argument("--tokenizer", help="tokenizer.json or a Hugging Face folder (default: train a BPE)")
    prep.add_argument("--vocab-size", type=int, default=8192,
                      help="size of the BPE trained when no --tokenizer is given (default: %(default)s)")
    prep.add_argument("--text-field", default="text",
                      help="the .jsonl field / .parquet column (default: %(default)s)")
    prep.add_argument("--format", choices=FORMATS, default="auto",
                      help='what the .jsonl/.parquet rows hold: chat ("messages"), completion ("prompt" + '
                           '"completion") or text; auto: from the first row\'s fields (default: %(default)s)')
    prep.add_argument("--chat-template", metavar="FILE",
                      help="a Jinja chat template file for chat data (default: the tokenizer's "
                           "chat_template from its tokenizer_config.json)")
    prep.add_argument("--train-on-prompt", action="store_true",
                      help="mask.bin counts every token (default: only assistant turns / completions)")
    prep.add_argument("--workers", type=int, help="tokenizer processes (default: every core)")
    prep.add_argument("--max-files", type=int, help="read at most this many files (default: all)")
    prep.add_argument("--val-fraction", type=float, default=0.02,
                      help="share of documents held out for validation (default: %(default)s)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.add_argument("--json", action="store_true", help="print the manifest's figures as JSON")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.data is not None and not Path(args.data).exists():
        raise DataError(f"data path {args.data!r} does not exist: point --data at a file or folder of text")
    if args.workers is not None and args.workers < 1:
        raise DataError(f"--workers must be >= 1 (got {args.workers})")
    opts = PrepareOptions(vocab_size=args.vocab_size, text_field=args.text_field, max_files=args.max_files,
                          tokenizer=tokenizer_file(args.tokenizer) if args.tokenizer else None,
                          workers=args.workers, val_fraction=args.val_fraction, progress=not args.no_progress,
                          fmt=args.format, train_on_prompt=args.train_on_prompt,
                          chat_template=Path(args.chat_template) if args.chat_template else None)
    folder = prepare(args.data, opts, out=Path(args.out))
    m = read_manifest(folder)
    keys = ("n_tokens", "n_documents", "dtype", "data_hash", "input_bytes", "tokenize_mb_per_s", "workers")
    summary = {"folder": str(folder), **{k: m[k] for k in keys}, "tokenizer": m["tokenizer"],
               "format": m.get("data_format", "text")}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{folder}: {m['n_tokens']:,} tokens ({m['dtype']}) in {m['n_documents']:,} documents "
              f"from {m['input_bytes'] / 1e6:,.1f} MB; tokenized at {m['tokenize_mb_per_s']} MB/s "
              f"with {m['workers']} worker(s); train on it with: paratrain train --data {folder}")
    return 0
