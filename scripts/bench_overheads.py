"""Overheads outside the attention kernels: compiled vs eager training steps, and decoding time per token against
the cache length, for ``"dilated"`` and ``"sdpa"`` on an 8-layer SmolLM2-shaped Llama (random weights).

Issue 9 items 7 and 8: ``torch.compile(fullgraph=True)`` must not be slower than eager, and per-token decoding work
outside the kernel must not grow with the cache (static cache: flat within 1.2x; dynamic cache: no more growth
than sdpa). Decoding is timed without a mask and, as ``generate()`` calls the model, with a 2-D mask of the whole
sequence so far. Each row is checked (the compiled step's loss equals eager's; decoding emits finite logits, and for
``dilated`` the Triton decode kernel is the one launch per layer).

Training rows: one step (forward, loss, backward; ``use_cache=False``) eager, the whole model compiled with
``fullgraph=True``, and each decoder layer compiled on its own (the usual per-block compile, which leaves the
embedding, LM head and loss eager). Decoding rows: static cache at 16K, 128K and 1M (sdpa where its prefill mask
fits, up to ``--sdpa-max-cache``), dynamic cache at 16K and 128K (``--dynamic-lengths``).

  python scripts/bench_overheads.py --small                  # CPU, seconds: tiny model, short lengths
  python scripts/bench_overheads.py --out DIR                # GPU (about 5 min on an H100): SmolLM2 shape, bf16

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
from hf_dilated.ops.triton import launch


def model_for(args, attn: str, context: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256) \
        if args.small else dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                                vocab_size=49152)
    cfg = LlamaConfig(num_hidden_layers=8, max_position_embeddings=max(context, 8192), tie_word_embeddings=True,
                      rope_theta=100000.0, **shape)
    model = LlamaForCausalLM(cfg).to(args.device, args.dtype)
    if attn == ATTENTION_NAME:
        ws, rs = default_branches(context, max_first_segment=args.min_segment)
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
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss.detach()

        eager_loss = step(model)
        eager = timed(lambda: step(model), args.device, args.reps)
        row = dict(kind="train_step", attn=attn, tokens=args.train_len, eager_ms=1e3 * statistics.median(eager),
                   loss_eager=float(eager_loss))
        for how in ("model", "layers"):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            if how == "model":
                fn = torch.compile(model, fullgraph=True)
            else:  # per-block compile: every decoder layer, one shared graph
                for layer in model.model.layers:
                    layer.compile(fullgraph=True)
                fn = model
            try:
                t0 = time.perf_counter()
                compiled_loss = step(fn)
                sync(args.device)
                row[f"compile_{how}_s"] = time.perf_counter() - t0
                row[f"compiled_{how}_ms"] = 1e3 * statistics.median(timed(lambda: step(fn), args.device, args.reps))
                row[f"loss_compiled_{how}"] = float(compiled_loss)
                row[f"losses_agree_{how}"] = abs(float(compiled_loss) - float(eager_loss)) <= 1e-2 * abs(float(eager_loss))
                row[f"compiled_{how}_over_eager"] = row[f"compiled_{how}_ms"] / row["eager_ms"]
                stats = torch._dynamo.utils.counters
                row[f"graphs_{how}"] = int(stats["stats"]["unique_graphs"])
                row[f"graph_breaks_{how}"] = int(sum(stats["graph_break"].values()))
            except Exception as error:  # e.g. the PyTorch reference on CPU is not fullgraph-traceable: say so, go on
                row[f"compile_{how}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            finally:
                for layer in model.model.layers:
                    layer._compiled_call_impl = None  # back to eager for the next variant
        rows.append(row)
        print(rows[-1], flush=True)
        del model
    return rows


@torch.no_grad()
def decode_rows(args) -> list[dict]:
    rows = []
    for cache_kind, lengths in (("static", args.cache_lengths), ("dynamic", args.dynamic_lengths)):
        for attn in (ATTENTION_NAME, "sdpa"):
            for length in lengths:
                if attn == "sdpa" and length > args.sdpa_max_cache:
                    # sdpa's mask for a chunk of prefill against a long static cache is [chunk, cache] (16 GiB at 1M)
                    rows.append(dict(kind="decode", cache=cache_kind, attn=attn, cache_len=length,
                                     skipped=f"longer than --sdpa-max-cache {args.sdpa_max_cache}"))
                    continue
                model = model_for(args, attn, length).eval()
                ids = torch.randint(0, model.config.vocab_size, (1, length), device=args.device)
                total = length + 2 * args.decode_steps + 1  # room for the steps without and with a 2-D mask
                cache = StaticCache(config=model.config, max_cache_len=total) if cache_kind == "static" \
                    else DynamicCache(config=model.config)
                t0 = time.perf_counter()
                for start in range(0, length, args.prefill_chunk):  # chunked prefill keeps activations small
                    model(input_ids=ids[:, start : start + args.prefill_chunk], past_key_values=cache, use_cache=True)
                sync(args.device)
                prefill_s = time.perf_counter() - t0
                token = ids[:, -1:]
                position = length

                mask = torch.ones(1, length + 2 * args.decode_steps + 1, dtype=torch.long, device=args.device)

                def one(with_mask=False):
                    nonlocal token, position
                    pos = torch.tensor([[position]], device=args.device)
                    extra = dict(attention_mask=mask[:, : position + 1]) if with_mask else {}
                    out = model(input_ids=token, past_key_values=cache, use_cache=True, position_ids=pos,
                                cache_position=pos[0], **extra)
                    token = out.logits[:, -1:].argmax(-1)
                    position += 1
                    return out.logits

                finite = bool(torch.isfinite(one()).all())
                launch.LAUNCHES.clear()
                times = timed(one, args.device, args.decode_steps - 1)
                row = dict(kind="decode", cache=cache_kind, attn=attn, cache_len=length,
                           ms_per_token=1e3 * statistics.median(times), ms_min=1e3 * min(times), finite=finite,
                           prefill_s=prefill_s)
                if attn == ATTENTION_NAME:
                    row["launches_per_token"] = {k: v / len(times) for k, v in launch.LAUNCHES.items()}
                # As generate() calls it: a 2-D mask of the whole sequence so far (all ones, no padding) every step.
                times = timed(lambda: one(with_mask=True), args.device, args.decode_steps - 1)
                row["ms_per_token_with_2d_mask"] = 1e3 * statistics.median(times)
                rows.append(row)
                print(rows[-1], flush=True)
                del model, cache
    for cache_kind in ("static", "dynamic"):
        for attn in (ATTENTION_NAME, "sdpa"):
            series = [r for r in rows if r.get("cache") == cache_kind and r["attn"] == attn and "ms_per_token" in r]
            if len(series) > 1:
                rows.append(dict(kind="decode_growth", cache=cache_kind, attn=attn, lengths=[series[0]["cache_len"],
                                 series[-1]["cache_len"]],
                                 longest_over_shortest=series[-1]["ms_per_token"] / series[0]["ms_per_token"],
                                 longest_over_shortest_with_2d_mask=series[-1]["ms_per_token_with_2d_mask"]
                                 / series[0]["ms_per_token_with_2d_mask"]))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model and lengths (CPU, seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--train-len", type=int, default=None)
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=None, help="static-cache lengths")
    parser.add_argument("--dynamic-lengths", type=int, nargs="+", default=None, help="dynamic-cache lengths")
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
    args.dynamic_lengths = args.dynamic_lengths or ([128, 2048] if args.small else [16384, 131072])
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
