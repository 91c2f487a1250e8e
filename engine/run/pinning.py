"""Host memory the GPU copies from or reads in place: `register_host` pins an existing mapping
(a shared-memory slab, the grammar helpers' memfd) with cudaHostRegister, and undoes it at
the right time.

The rule it keeps: a registration is undone before its mapping is unmapped. A stale one
makes a later mapping at the same address fail to register (seen on the H200 when a second
runner in one process mapped its grammar bitmask where the first one's had been).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def register_host(owner: object, t: torch.Tensor, keep: Any, what: str) -> weakref.finalize:
    """Register `t`'s memory; the returned finalizer unregisters it when `owner` goes (or when
    called, e.g. on close) and only then lets `keep` (what holds the mapping) go."""
    ptr = t.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {what} failed: {err}")
    finalizer = weakref.finalize(owner, _unregister, ptr, keep)
    finalizer.atexit = False  # an exiting process needs no unregister (nor CUDA calls then)
    return finalizer


def _unregister(ptr: int, keep: Any) -> None:
    """cudaHostUnregister, then let the mapping go (it is held until now)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter exit: the CUDA context may be gone already
        pass
    del keep
