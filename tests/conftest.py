import os

# Triton kernels (ours and vLLM's oracle kernels) run on the CPU only through the interpreter; it must be
# on before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
