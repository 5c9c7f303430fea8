"""Hugging Face folders in and out, whatever the family: the format-generic half of the mapping.

files.py: the folder, its JSON, its safetensors files and index (never a pickle), the tokenizer and
chat-template files; checkpoint.py: ``HFCheckpoint`` (a family's hf.py subclasses it with its own
names and layouts, and registers it), the shape checks before allocation, loading, the checks of
``--init-from``; write.py: streamed, sharded safetensors; export.py: ``paratrain export --hf``.
"""

from paratrain.models.hf.checkpoint import (
    TRAIN_OVERRIDES,
    HFCheckpoint,
    TensorSource,
    architectures,
    check_init_from,
    check_seq_len,
    checkpoint_class,
    checkpoint_class_for,
    expected_shapes,
    load_pretrained,
    read_slice,
    register_checkpoint,
)
from paratrain.models.hf.files import (
    TEMPLATE_DIR,
    TOKENIZER_FILES,
    HFError,
    hf_folder,
    read_json,
    tokenizer_file,
    weight_files,
)
from paratrain.models.hf.write import Entry, write_safetensors, write_sharded

__all__ = ["TEMPLATE_DIR", "TOKENIZER_FILES", "TRAIN_OVERRIDES", "Entry", "HFCheckpoint", "HFError",
           "TensorSource",
           "architectures", "check_init_from", "check_seq_len", "checkpoint_class", "checkpoint_class_for",
           "expected_shapes", "hf_folder", "load_pretrained", "read_json", "read_slice",
           "register_checkpoint", "tokenizer_file", "weight_files", "write_safetensors", "write_sharded"]
