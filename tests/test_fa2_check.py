"""The check that tells a user when vLLM's FlashAttention-2 (its path for the layers a TurboQuant cache keeps
uncompressed) has no native code for their GPU: reading a library's embedded CUDA fat binaries."""

import os
import struct

import pytest

from tqkv_compile.vllm.adapter import fatbin_archs, fa2_jit_warning

PTX, SASS = 1, 2


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    """A CUDA fat binary as nvcc embeds it: a 16-byte header, then entries of a 64-byte header and a payload."""
    body = b""
    for kind, arch, payload in entries:
        header = bytearray(64)
        struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
        struct.pack_into("<I", header, 28, arch)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_fatbin_archs_reads_every_entry_of_every_fat_binary_in_a_library():
    library = (os.urandom(3000).replace(b"\x50\xed\x55\xba", b"")
               + _fatbin([(SASS, 80, b"\x7fELF" + bytes(200)), (PTX, 80, b".version 8.0" + bytes(100))])
               + bytes(512)
               + _fatbin([(SASS, 86, bytes(64)), (PTX, 90, bytes(32))]))
    assert fatbin_archs(library) == {"sass": [80, 86], "ptx": [80, 90]}
    assert fatbin_archs(b"no fat binary here") == {"sass": [], "ptx": []}


@pytest.mark.parametrize("capability, archs, expected", [
    ((9, 0), {"sass": [80], "ptx": [80]}, "from sm_80 PTX"),  # vLLM 0.20's wheel on an H100 / H200
    ((8, 6), {"sass": [80], "ptx": [80]}, None),  # sm_80 code runs on sm_86
    ((8, 0), {"sass": [86], "ptx": [86]}, "cannot run"),  # sm_86 code does not run on sm_80, nor does its PTX
    ((9, 0), {"sass": [80, 90], "ptx": [90]}, None),
    ((9, 0), None, None),  # no FA2 library (CPU builds)
])
def test_fa2_warning_names_the_missing_architecture_only_when_it_is_missing(capability, archs, expected):
    message = fa2_jit_warning(archs, capability, cache_maxsize=None)
    if expected is None:
        assert message is None
    else:
        assert expected in message and f"sm_{capability[0]}{capability[1]}" in message


def test_fa2_warning_advises_the_jit_cache_size_only_when_it_is_not_set():
    archs = {"sass": [80], "ptx": [80]}
    assert "CUDA_CACHE_MAXSIZE=4294967296" in fa2_jit_warning(archs, (9, 0), cache_maxsize=None)
    assert "`tqkv warm-fa2` compiles them ahead" in fa2_jit_warning(archs, (9, 0), cache_maxsize=None)
    assert "CUDA_CACHE_MAXSIZE" not in fa2_jit_warning(archs, (9, 0), cache_maxsize="4294967296")


def test_fa2_warning_says_nothing_when_the_library_could_not_be_read():
    assert fa2_jit_warning({"sass": [], "ptx": []}, (9, 0), cache_maxsize=None) is None
