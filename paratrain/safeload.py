"""Reading files paratrain may not have written (a Hugging Face folder, a checkpoint from a shared
file system or a download, a tokenizer folder) without trusting them.

Nothing read here runs code: JSON is parsed, safetensors headers are parsed and checked against
the file's size, and torch files load with ``weights_only=True`` (tensors, numbers, strings, lists,
tuples, dicts). The one exception, a pickle of an older checkpoint, is unpickled in full only when
the user says they trust it (``--trust-checkpoint``), and then with a warning.

Every reader takes the caller's error class (HFError, CheckpointError, DataError: ValueErrors the
CLI prints as one line with exit status 2) and names the file, and the field in it, that is wrong.
One place for every model family's config checks (models/hf/, models/families/llama/hf.py,
models/families/gpt2/hf.py), the checkpoint index and the tokenizer folder. torch is imported only by the
two functions that load or save torch files: the data layer uses this module and stays free of
torch at import time.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import warnings
from pathlib import Path, PurePosixPath

from safetensors import SafetensorError, safe_open

TRUST_HINT = "--trust-checkpoint (library: Parallel.load(..., trust_checkpoint=True))"
_REQUIRED = object()


def _kind(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """The JSON object (``{...}``) in ``path``; ``error`` names the file when it is unreadable, not
    JSON, or another JSON value (a list, a string)."""
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {_kind(data)} where an object ({{...}}) belongs: is it the right "
                    "file, saved whole?")
    return data


class Fields:
    """Typed reads of a JSON object's fields: a wrong or missing one raises ``error`` naming
    ``where`` (the file) and the field. JSON ``null`` counts as missing (transformers writes it)."""

    def __init__(self, data: dict, where: str, error: type[Exception]):
        self.data, self.where, self.error = data, where, error

    def _get(self, key: str, default: object, what: str) -> object:
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.error(f"{self.where}: {key} is missing; it must be {what}")
            return default
        return value

    def _wrong(self, key: str, value: object, what: str) -> Exception:
        return self.error(f"{self.where}: {key} is {json.dumps(value)} (a {_kind(value)}); it must be {what}")

    def integer(self, key: str, default: object = _REQUIRED, *, minimum: int = 1) -> int:
        what = f"an integer >= {minimum}"
        value = self._get(key, default, what)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._wrong(key, value, what)
        return value

    def number(self, key: str, default: object = _REQUIRED, *, positive: bool = False) -> float:
        """A finite number: Python's JSON reads ``NaN`` and ``Infinity``, which no setting means (an
        infinite epsilon or LoRA alpha only surfaces later, as a non-finite loss blamed on the lr)."""
        what = "a finite number > 0" if positive else "a finite number"
        value = self._get(key, default, what)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            raise self._wrong(key, value, what)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default, "true or false")
        if not isinstance(value, bool):
            raise self._wrong(key, value, "true or false")
        return value

    def text(self, key: str, default: object = _REQUIRED) -> str:
        value = self._get(key, default, "a string")
        if value is not default and not isinstance(value, str):
            raise self._wrong(key, value, "a string")
        return value

    def obj(self, key: str) -> dict:
        """A nested object, or {} when absent."""
        value = self._get(key, {}, "an object")
        if not isinstance(value, dict):
            raise self._wrong(key, value, "an object ({...})")
        return value


def member(folder: Path, name: object, where: str, error: type[Exception]) -> Path:
    """``folder / name`` for a file an index lists. Refused unless ``name`` stays inside the folder
    (relative, no ``..``): an index from elsewhere must not make paratrain read other files. Not
    resolved through links: a Hugging Face cache snapshot links its files to ../../blobs."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or parts[0] == "/" or ".." in parts or "\\" in name:
        raise error(f"{where} names the file {json.dumps(name)}, which is not inside {folder}: an index may "
                    "only name files in its own folder (no absolute paths, no '..'); fix or replace it")
    return Path(folder) / name


def safetensors_names(path: Path, error: type[Exception]) -> list[str]:
    """The tensor names of a safetensors file, once its header parses and the file holds every byte
    the header declares (a truncated copy or a renamed pickle is refused here, naming the file)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except (SafetensorError, OSError) as e:
        raise error(f"{path} is not a readable safetensors file ({e}): it is truncated or damaged; "
                    "copy or download it again") from None


def to_data_bytes(obj: object, what: str) -> bytes:
    """``torch.save(obj)``'s bytes, after checking they load back with ``weights_only=True``: only
    tensors, numbers, strings, None and lists/tuples/dicts of them are written (TypeError otherwise)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except pickle.UnpicklingError as e:
        raise TypeError(f"{what}: {_unsupported(e)} cannot be saved; a checkpoint stores only tensors, "
                        "numbers, strings, None and lists/tuples/dicts of them (so loading it runs no code): "
                        "convert the rest in state_dict / load_state_dict") from None
    return buf.getvalue()


def load_data(path: Path, error: type[Exception], *, trust: bool = False) -> object:
    """A torch file loaded as plain data (``weights_only=True``). A file that needs more (an older
    checkpoint's pickle, or one crafted to run code when unpickled) is refused with ``error``
    unless ``trust``; then it is unpickled in full, with a warning."""
    import torch

    try:
        with warnings.catch_warnings():  # torch's note on a raw pickle's protocol: ours says more
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if not trust:
            raise error(f"{path} is not plain data: it holds {_unsupported(e)}, which only a full unpickling "
                        "would build, and unpickling can run any code (a checkpoint from an older paratrain, "
                        "or one crafted to). It was not loaded. If you trust where this checkpoint came "
                        f"from, rerun with {TRUST_HINT}; otherwise use a checkpoint you wrote") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise error(f"{path} cannot be read ({type(e).__name__}: {e}): the file is damaged") from None
    warnings.warn(f"{path}: unpickling in full as --trust-checkpoint asks: this can run code stored in the "
                  "file. Save again with this paratrain to store plain data only", stacklevel=2)
    try:
        return torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure of a full unpickling is a damaged file
        raise error(f"{path} cannot be read ({type(e).__name__}: {e}): the file is damaged") from None


def _unsupported(e: pickle.UnpicklingError) -> str:
    """What the weights-only unpickler refused, from its message (e.g. "'builtins.open'")."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
    if found:
        return f"'{found.group(1)}'"
    found = re.search(r"Unsupported operand (\d+)", str(e))
    return f"pickle instructions beyond plain data (opcode {found.group(1)})" if found else "Python objects"
