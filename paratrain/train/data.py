"""The trainer's view of the data; the implementation lives in ``paratrain.data``.

Kept so that ``from paratrain.train.data import ...`` (tests, users' scripts) keeps working.
"""

from paratrain.data import (  # noqa: F401
    EOT,
    Corpus,
    DataError,
    TokenRows,
    cache_root,
    check_cursor,
    corpus_files,
    data_cursor,
    load_corpus,
    prepare_corpus,
    read_documents,
    stdlib_dir,
)
