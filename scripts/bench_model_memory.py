"""Whole-model peak memory and time of a patched checkpoint against the same model on dense ``sdpa`` (issue 9,
item 2): a random-weight Gemma3-270M-shaped decoder (18 layers, five of six with a 512-token sliding window, 4 query
heads on 1 kv head, head dim 256), patched with its recipe (local layers kept exact through the kernels' window,
global layers dilated), in bfloat16, one forward pass (no KV cache, logits of the last token only, as prefill does)
and one forward+backward pass, at each length.

Weights do not change memory or time, so random ones measure what a real checkpoint of this shape would.

    python scripts/bench_model_memory.py --lengths 16384 32768 65536 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

import hf_dilated
from hf_dilated.environment import run_environment


def gemma3_shaped(dtype: torch.dtype):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
        attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).to(device="cuda", dtype=dtype)


def measure(model, n: int, backward: bool) -> dict:
    """Peak memory above the weights and time of one pass at ``n`` tokens; NaN where it does not fit."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        times = []
        for _ in range(3):  # the first pass compiles kernels; report the best of the next two
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.set_grad_enabled(backward):
                out = model(input_ids=ids, logits_to_keep=1)
                if backward:
                    out.logits.float().sum().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del out
            model.zero_grad(set_to_none=True)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        return {"ms": 1e3 * min(times[1:]), "peak_gib_above_weights": peak}
    except torch.OutOfMemoryError:
        return {"ms": float("nan"), "peak_gib_above_weights": float("nan"), "oom": True}
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.lengths):
        parser.error(f"--lengths must be integers >= 2, got {args.lengths}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    rows = []
    model = gemma3_shaped(torch.bfloat16)
    for attention in ("sdpa", "dilated"):
        if attention == "dilated":
            hf_dilated.patch(model, context_length=max(args.lengths))
        for n in args.lengths:
            for backward in (False, True):
                row = {"attention": attention, "n": n, "backward": backward, **measure(model, n, backward)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    ratios = {}
    for n in args.lengths:
        for backward in (False, True):
            pick = {r["attention"]: r for r in rows if r["n"] == n and r["backward"] == backward}
            key = f"{n}_{'fwd_bwd' if backward else 'fwd'}"
            ratios[key] = pick["dilated"]["peak_gib_above_weights"] / pick["sdpa"]["peak_gib_above_weights"]
    result = {
        "what": "Gemma3-270M-shaped model (random weights, bf16), peak GiB above the weights, dilated (recipe) vs sdpa",
        "environment": run_environment(dtype=torch.bfloat16),
        "rows": rows,
        "memory_ratio_dilated_over_sdpa": ratios,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"model_memory-{torch.cuda.get_device_name().replace(' ', '_')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(ratios), "->", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
