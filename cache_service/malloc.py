"""Keep large blocks in the malloc heap: the biggest single cost of a hit on 256 KiB+ artifacts.

Hazard: glibc serves every allocation of 128 KiB or more (the default M_MMAP_THRESHOLD) with a
fresh mmap and returns it with munmap on free. A hit allocates several such buffers (the bytes,
the protobuf arena, the serialized response, gRPC's copy), so each one page-faults its pages in
and zeroes them again: a 256 KiB Lookup plus its serialization took 230-320 us of server time,
28 us with large blocks kept in the heap (measured on the 2-core dev VM, docs/cache_service.md).
Contract: `keep_large_blocks_in_heap()` raises the mmap threshold to 32 MiB (glibc's ceiling on
64-bit, and the largest artifact the server accepts) and the trim threshold to 256 MiB, once per
process; elsewhere than glibc it does nothing and returns False.
Cost: freed large blocks stay mapped (up to the trim threshold) instead of going back to the OS
at once, so the resident size follows the peak of in-flight responses, not the current one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
_applied = False


def keep_large_blocks_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where that is not glibc."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        log.warning("mallopt refused the large-block thresholds; hits stay slower")
    _applied = ok
    return ok
