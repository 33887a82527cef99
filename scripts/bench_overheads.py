"""Overheads outside the attention kernels: compiled vs eager training steps, and decoding time per token against
the cache length, for ``"dilated"`` and ``"sdpa"`` on an 8-layer SmolLM2-shaped Llama (random weights).

Issue 9 items 7 and 8: ``torch.compile(fullgraph=True)`` must not be slower than eager, and per-token decoding work
outside the kernel must not grow with the cache (static cache: flat within 1.2x; dynamic cache: no more growth
than sdpa). Each row is checked (the compiled step's loss equals eager's; decoding emits finite logits).

  python scripts/bench_overheads.py --small                  # CPU, seconds: tiny model, short lengths
  python scripts/bench_overheads.py                          # GPU: 16K training, 16K..1M cache (SmolLM2 shape)

Writes ``benchmarks/results/overheads-<device>-<date>.json`` with the environment (versions, device, command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import hf_dilated
from hf_dilated import ATTENTION_NAME, DilatedAttentionConfig, default_branches
from hf_dilated.environment import run_environment


def model_for(args, attn: str, context: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256) \
        if args.small else dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                                vocab_size=49152)
    cfg = LlamaConfig(num_hidden_layers=8, max_position_embeddings=max(context, 8192), tie_word_embeddings=True,
                      rope_theta=100000.0, **shape)
    model = LlamaForCausalLM(cfg).to(args.device, args.dtype)
    if attn == ATTENTION_NAME:
        ws, rs = default_branches(context, min_segment=args.min_segment)
        DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, backend=args.backend).save_to(model.config)
    model.set_attn_implementation(attn)
    return model


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def training_rows(args) -> list[dict]:
    rows = []
    for attn in (ATTENTION_NAME, "sdpa"):
        model = model_for(args, attn, args.train_len).train()
        ids = torch.randint(0, model.config.vocab_size, (1, args.train_len), device=args.device)

        def step(m):
            model.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        eager_loss = step(model)
        eager = timed(lambda: step(model), args.device, args.reps)
        row = dict(kind="train_step", attn=attn, tokens=args.train_len, eager_ms=1e3 * statistics.median(eager),
                   loss_eager=float(eager_loss))
        torch._dynamo.reset()
        compiled_model = torch.compile(model, fullgraph=True)
        try:
            t0 = time.perf_counter()
            compiled_loss = step(compiled_model)
            sync(args.device)
            row["compile_s"] = time.perf_counter() - t0
            row["compiled_ms"] = 1e3 * statistics.median(timed(lambda: step(compiled_model), args.device, args.reps))
            row["loss_compiled"] = float(compiled_loss)
            row["losses_agree"] = abs(float(compiled_loss) - float(eager_loss)) <= 1e-2 * abs(float(eager_loss))
            row["compiled_over_eager"] = row["compiled_ms"] / row["eager_ms"]
        except Exception as error:  # e.g. the PyTorch reference on CPU is not fullgraph-traceable: say so, go on
            row["compile_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def decode_rows(args) -> list[dict]:
    rows = []
    for cache_kind in ("static", "dynamic"):
        for attn in (ATTENTION_NAME, "sdpa"):
            for length in args.cache_lengths:
                if attn == "sdpa" and length > args.sdpa_max_cache:
                    # sdpa's mask for a chunk of prefill against a long static cache is [chunk, cache] (16 GiB at 1M)
                    rows.append(dict(kind="decode", cache=cache_kind, attn=attn, cache_len=length,
                                     skipped=f"longer than --sdpa-max-cache {args.sdpa_max_cache}"))
                    continue
                model = model_for(args, attn, length).eval()
                ids = torch.randint(0, model.config.vocab_size, (1, length), device=args.device)
                total = length + args.decode_steps + 1
                cache = StaticCache(config=model.config, max_cache_len=total) if cache_kind == "static" \
                    else DynamicCache(config=model.config)
                for start in range(0, length, args.prefill_chunk):  # chunked prefill keeps activations small
                    model(input_ids=ids[:, start : start + args.prefill_chunk], past_key_values=cache, use_cache=True)
                token = ids[:, -1:]
                position = length

                def one():
                    nonlocal token, position
                    pos = torch.tensor([[position]], device=args.device)
                    out = model(input_ids=token, past_key_values=cache, use_cache=True, position_ids=pos,
                                cache_position=pos[0])
                    token = out.logits[:, -1:].argmax(-1)
                    position += 1
                    return out.logits

                finite = bool(torch.isfinite(one()).all())
                times = timed(one, args.device, args.decode_steps - 1)
                rows.append(dict(kind="decode", cache=cache_kind, attn=attn, cache_len=length,
                                 ms_per_token=1e3 * statistics.median(times), finite=finite))
                print(rows[-1], flush=True)
                del model, cache
    for cache_kind in ("static", "dynamic"):
        for attn in (ATTENTION_NAME, "sdpa"):
            series = [r for r in rows if r.get("cache") == cache_kind and r["attn"] == attn and "ms_per_token" in r]
            rows.append(dict(kind="decode_growth", cache=cache_kind, attn=attn, lengths=[series[0]["cache_len"],
                             series[-1]["cache_len"]], longest_over_shortest=series[-1]["ms_per_token"] / series[0]["ms_per_token"]))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model and lengths (CPU, seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--train-len", type=int, default=None)
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=None)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--sdpa-max-cache", type=int, default=131072, help="longest cache to decode with sdpa")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    args.train_len = args.train_len or (256 if args.small else 16384)
    args.cache_lengths = args.cache_lengths or ([128, 512, 2048] if args.small else [16384, 131072, 1048576])
    args.min_segment = 64 if args.small else 2048
    args.prefill_chunk = 1024 if args.small else 16384
    rows = ([] if args.skip_train else training_rows(args)) + decode_rows(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = run_environment(args.device, args.dtype)
    name = "cpu" if not gpu else torch.cuda.get_device_name(args.device).replace(" ", "-")
    path = out / f"overheads-{name}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
