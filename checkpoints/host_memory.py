"""Large anonymous host buffers, backed by transparent huge pages where the kernel allows.

A restore reads a 19.8 GB state into fresh memory and the snapshot arena page-locks 22 GB:
with 4 KiB pages that is ~5 million page faults (each zeroing a page, serialised on the
process's memory-map lock when many reader threads fault at once) and as many pages for
`cudaHostRegister` to pin. `MADV_HUGEPAGE` asks for 2 MiB pages instead (512x fewer), when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`; elsewhere it changes
nothing and the buffer is an ordinary mapping.
"""

from __future__ import annotations

import mmap


def anonymous_buffer(nbytes: int) -> mmap.mmap:
    """A private, zero-filled mapping of `nbytes` (> 0), advised to use huge pages."""
    buf = mmap.mmap(-1, nbytes)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    return buf
