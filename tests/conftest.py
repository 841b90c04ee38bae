import os

# Triton kernels (ours and vLLM's oracle kernels) run on the CPU only through the interpreter; it must be
# on before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels_stay_in_bounds(request):
    """Tests marked ``interpret`` run every Triton kernel under tests/bounds.py's checker: a load or store
    outside the launch's tensors fails the test (on the GPU it is silent or a fault, depending on the page)."""
    if request.node.get_closest_marker("interpret") is None:
        yield
        return
    from bounds import checked_bounds

    with checked_bounds():
        yield
