"""run.reuse_freed_memory: glibc keeps freed large blocks in the heap (allocator.py)."""

import ctypes
import platform

import pytest

from nearpolicy.allocator import reuse_freed_memory

glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _mmapped_bytes() -> int:
    """glibc's count of bytes currently held in mmap'ed chunks (mallinfo2().hblkhd)."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().hblkhd


@pytest.mark.skipif(not glibc, reason="mallopt is glibc's; elsewhere reuse_freed_memory is a documented no-op")
def test_a_large_block_comes_from_the_heap_only_when_switched_on():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20  # above glibc's largest mmap threshold (32 MiB)
    try:
        assert reuse_freed_memory(False)
        before = _mmapped_bytes()
        block = libc.malloc(size)
        assert _mmapped_bytes() - before >= size  # default: served by mmap
        libc.free(block)
        assert reuse_freed_memory(True)
        before = _mmapped_bytes()
        block = libc.malloc(size)
        assert _mmapped_bytes() - before < size  # switched on: from the heap
        libc.free(block)
    finally:
        reuse_freed_memory(False)


def test_the_trainer_session_applies_the_config_key(monkeypatch):
    from nearpolicy import models, setup
    from nearpolicy.config import load_config

    seen = []
    monkeypatch.setattr(setup, "reuse_freed_memory", seen.append)

    def stop(path):
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(models, "resolve_model", stop)
    for value in (False, True):
        cfg = load_config(None, [f"run.reuse_freed_memory={str(value).lower()}"])
        with pytest.raises(FileNotFoundError, match="stop here"):
            setup.build_session(cfg, None, print)
    assert seen == [False, True]
