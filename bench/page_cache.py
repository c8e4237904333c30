"""The host's page cache, for benches that read from a disk: dropped, so that a read goes to
the disk and not to the copy a write left in memory."""

import os


def drop_caches():
    """Whether the page cache could be dropped (root only)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
