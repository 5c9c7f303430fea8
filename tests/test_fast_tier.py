"""``make test-fast`` (issue 36 item 6) runs the node ids of tests/fast.txt: each must name a test
that exists, or the edit loop's tier would stop at an error instead of running the checks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ROOT / "tests" / "fast.txt"


def test_every_fast_entry_names_an_existing_test():
    entries = [line.strip() for line in FAST.read_text().splitlines() if line.strip()]
    assert len(entries) == len(set(entries)), "an entry is listed twice"
    missing = []
    for entry in entries:
        path, _, name = entry.partition("::")
        source = ROOT / path
        function = name.split("[")[0]
        pattern = rf"^def {function}\("
        defined = source.is_file() and (not function or re.search(pattern, source.read_text(), re.M))
        if not defined:
            missing.append(entry)
    assert missing == [], f"tests/fast.txt names tests that do not exist: {missing}"
