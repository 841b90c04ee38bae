"""The command-line tools behind ``tqkv`` (:mod:`cli`): the demo, ``inspect``, ``doctor``, the quality
harness, the kernel and end-to-end benchmarks and the GPU kernel check. Nothing in the serving path imports
them."""
