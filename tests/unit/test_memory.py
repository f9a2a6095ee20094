"""aggd.lab.memory: the resident-memory figures the benchmarks report."""
from __future__ import annotations

import mmap

from aggd.lab import memory


def test_anonymous_growth_shows_in_the_peak_and_not_in_file_pages():
    memory.reset_peak_rss()
    base, base_files = memory.rss(), memory.mapped_file_rss()
    # fresh anonymous pages (an allocator could hand back memory that is already resident)
    with mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:
        for i in range(0, len(block), mmap.PAGESIZE):
            block[i] = 1
        grown = memory.peak_rss() - base
        assert grown >= 7 << 20
        assert memory.mapped_file_rss() - base_files < 1 << 20


def test_file_pages_touched_count_as_mapped_file_rss(tmp_path):
    path = tmp_path / "pages"
    path.write_bytes(b"\1" * (4 << 20))
    base = memory.mapped_file_rss()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        total = sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))  # touch every page
        assert total == len(m) // mmap.PAGESIZE
        assert memory.mapped_file_rss() - base >= 3 << 20
