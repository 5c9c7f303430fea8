"""Data at scale: sources that stream, a tokenizer, token files every rank memory-maps.

    sources.py    files, .jsonl, .parquet -> documents or rows, cut into tasks (never a whole file in memory)
    chat.py       instruction data: formats (chat, completion, text), their detection, tokens and loss masks
    template.py   chat templates: the Jinja dialect of Hugging Face tokenizers, rendered as transformers does
    template_bounds.py  the template sandbox bounded in time and output (loops, calls, sized operations)
    tokenizer.py  which tokenizer (given, from --init-from, or a BPE trained on a bounded sample)
    tokenfile.py  tasks -> a pool of tokenizer processes -> tokens.bin + docs.bin + manifest.json
    corpus.py     the prepared folder, memory-mapped; rows per step; the checkpoint's data cursor
    packing.py    rows of whole examples (packed or one per row): positions, masked targets (IGNORE_INDEX)

No module here imports torch at import time: the tokenizer workers stay light.
"""

from paratrain.data.corpus import (
    Corpus,
    TokenRows,
    check_batch_fits,
    check_cursor,
    data_cursor,
    load_corpus,
    load_eval_corpus,
    load_prepared,
    make_rows,
    prepare_corpus,
)
from paratrain.data.packing import IGNORE_INDEX, PackedRows
from paratrain.data.sources import DataError, corpus_files, read_documents, stdlib_dir
from paratrain.data.tokenfile import PrepareOptions, cache_root, prepare
from paratrain.data.tokenizer import EOT, check_vocab, resolve_tokenizer, train_bpe

__all__ = ["EOT", "IGNORE_INDEX", "Corpus", "PackedRows", "make_rows",
           "DataError", "PrepareOptions", "TokenRows", "cache_root", "check_batch_fits",
           "check_cursor", "check_vocab", "corpus_files", "data_cursor", "load_corpus", "load_eval_corpus",
           "load_prepared", "prepare", "prepare_corpus", "read_documents", "resolve_tokenizer", "stdlib_dir",
           "train_bpe"]
