"""run.reuse_freed_memory: glibc keeps freed large blocks in the heap (training/allocator.py)."""

import platform
import subprocess
import sys

import pytest

glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


PROBE = """
import ctypes

from nearpolicy.training.allocator import release_freed_memory, reuse_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20  # above glibc's largest mmap threshold (32 MiB)
grown = []
for enabled in (False, True):
    assert reuse_freed_memory(enabled)
    before = libc.mallinfo2().hblkhd  # bytes held in mmap'ed chunks
    block = libc.malloc(size)
    grown.append(libc.mallinfo2().hblkhd - before)
    libc.free(block)

def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096

block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
libc.free(block)
kept = rss()
release_freed_memory()
print(grown[0] >= size, grown[1] < size, kept - rss() > (200 << 20))
"""


@pytest.mark.skipif(not glibc, reason="mallopt is glibc's; elsewhere reuse_freed_memory is a documented no-op")
def test_a_large_block_comes_from_the_heap_only_when_switched_on():
    """In a fresh process (a process that had it on keeps a large free heap, which serves large blocks whatever the
    setting): untouched glibc maps a 64 MiB block; switched on, it comes from the heap, freed blocks stay resident,
    and release_freed_memory (once per update) hands them back."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]


def test_the_trainer_session_applies_the_config_key(monkeypatch):
    from nearpolicy.model import load as models
    from nearpolicy.training import assemble as setup
    from nearpolicy.config.schema import load_config

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


def test_switching_off_is_a_no_op_unless_it_was_switched_on(monkeypatch):
    """mallopt turns glibc's dynamic mmap threshold off for good: `False` must not call it in an untouched process."""
    from nearpolicy.training import allocator

    calls = []

    class Mallopt:  # a ctypes function stand-in: argtypes / restype are set on it
        def __call__(self, param, value):
            calls.append((param, value))
            return 1

    class FakeLibc:
        mallopt = Mallopt()

    monkeypatch.setattr(allocator, "_libc", FakeLibc)
    monkeypatch.setattr(allocator, "_state", {"enabled": False})
    assert allocator.reuse_freed_memory(False) and calls == []
    assert allocator.reuse_freed_memory(True) and calls == list(allocator.REUSE.items())
    assert allocator.reuse_freed_memory(False) and calls[2:] == list(allocator.GLIBC_DEFAULTS.items())

