"""The handle every patch of the transformers integration returns: the attributes it set, restored in reverse
order, and ``with`` semantics."""
from __future__ import annotations

import threading
from typing import List, Tuple


class _Patch:
    """What a patch handle shares: the attributes it set (restored in reverse order) and ``with`` semantics."""

    # one lock for every handle: patching and unpatching change module functions and class attributes that
    # several handles can share
    _lock = threading.Lock()

    def __init__(self, model=None):
        self.model = model
        self._saved: List[Tuple[object, str, object, bool]] = []  # (owner, attr, previous, had_own_attr)
        self.active = False

    def _set(self, owner, attr, value):
        had = attr in vars(owner)
        self._saved.append((owner, attr, vars(owner).get(attr), had))
        setattr(owner, attr, value)

    def _restore(self) -> None:
        for owner, attr, prev, had in reversed(self._saved):
            if had:
                setattr(owner, attr, prev)
            else:
                delattr(owner, attr)
        self._saved.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()
        return False
