"""Dilated attention on plain layouts as batches of segment buckets on PyTorch's fused attention kernels.

On a plain layout (each batch row one sequence at positions ``0..N-1``, queries are the keys, nothing masked) branch
``(w, r)`` selects, for query head ``h`` with offset ``o = (h + head_offset) % r``, the columns ``s w + o + j r`` of
each segment ``s``: a *bucket* of ``w / r`` rows whose attention is ordinary attention (causal or not) among
themselves. Every full segment of every head is gathered into one batch ``[B * segments, Hq, w / r, D]`` and the
branch is one call of a fused kernel that also returns the log-sum-exp; the last, shorter segment is one or two more
calls (heads whose offset selects one row fewer there apart). Branches are merged by their lse (SPEC.md).

Backward (the ring-attention trick): each bucket's fused backward, given the *merged* output and lse gathered to its
rows and the unweighted ``dO``, forms ``P = exp(S - lse) = w_i P_i`` and ``delta = rowsum(dO * O)``: exactly its
share of the gradient of the merged output. A gradient ``dL`` through the returned lse adds ``P dL`` to ``dS``, i.e.
``delta - dL``; it rides in extra head-dim columns (``q, k, v`` padded with 0, ``o' = [o, -1, -1]``,
``dO' = [dO, dL_hi, dL_lo]``, ``dL`` split so that half precision does not round it). The fused ops are private ATen
ops: each is probed once per (device, dtype, head dim) with a tiny call checked against plain math, and
:func:`route` says why a call cannot take this path.

Right padding of a causal batch is exact here too: a real query reaches only earlier, real keys. The padding rows'
outputs are set to 0 and their lse to -inf (as the tiled path gives them), and no gradient flows from them. Left
padding is rotated, row by row, into right padding (positions are unchanged: they count from the first real token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from .layout import TokenLayout, _IdentityMemo

_HALF = (torch.float16, torch.bfloat16)
_LSE_ALIGN = 32  # the memory-efficient kernel pads its lse rows to a multiple of 32


# ---------------------------------------------------------------------------------------------------------------
# The fused kernels: one forward (out, lse) and one backward (dq, dk, dv) per kind, q/k/v [batch, heads, L, D].


def _flash_cpu_fwd(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, scale=scale)
    # PyTorch's CPU flash kernel (2.13, float32 / bf16, under 16 rows) returns 0 and lse 0 for a row whose scores are
    # all NaN (a NaN in its query, or in the one key a segment's first causal row sees), where SPEC's formula and every
    # other backend give NaN: put the NaN back on every row that reads a NaN query or key, so a diverging run shows it.
    q_nan, k_nan = q.isnan().any(-1), k.isnan().any(-1)  # [b, h, L]
    if q_nan.any() or k_nan.any():
        k_nan = k_nan.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        seen = k_nan.cummax(-1).values if causal and q.shape[2] == k.shape[2] else k_nan.any(-1, keepdim=True)
        rows = q_nan | seen
        out, lse = out.masked_fill(rows[..., None], math.nan), lse.masked_fill(rows, math.nan)
    return out, lse


def _flash_cpu_bwd(do, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        do, q, k, v, out, lse, 0.0, causal, scale=scale)


_RNG: dict = {}  # (op, device) -> the random-number state tensors its last forward returned (unused without dropout)


def _rng(op: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """What the CUDA backward ops take for the forward's random-number state: the tensors of the same op's last
    forward (any forward's do without dropout; SDPA's autograd passes them the same way)."""
    found = _RNG.get((op, str(device)))
    if found is None:
        blank = torch.empty((), dtype=torch.int64, device=device)
        return blank, blank
    return found


def _flash_cuda_fwd(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal, False, scale=scale)
    _RNG[("flash", str(q.device))] = (res[6], res[7])
    return res[0], res[1]


def _flash_cuda_bwd(do, q, k, v, out, lse, causal, scale):
    L = q.shape[2]  # dense batches: no cumulative lengths, the longest sequence is L
    seed, offset = _rng("flash", q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
        do, q, k, v, out, lse, None, None, L, L, 0.0, causal, seed, offset, scale=scale)


def _efficient_fwd(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_efficient_attention.default(
        q, k, v, None, True, 0.0, causal, scale=scale)
    _RNG[("efficient", str(q.device))] = (res[2], res[3])
    return res[0], res[1][..., : q.shape[2]]


def _efficient_bwd(do, q, k, v, out, lse, causal, scale):
    L = q.shape[2]
    seed, offset = _rng("efficient", q.device)
    padded = lse.new_zeros(*lse.shape[:-1], -(-L // _LSE_ALIGN) * _LSE_ALIGN)
    padded[..., :L] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(
        do, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


_CUDNN_LSE_4D: dict = {}


def _cudnn_fwd(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)
    _RNG[("cudnn", str(q.device))] = (res[6], res[7])
    lse = res[1]
    _CUDNN_LSE_4D[str(q.device)] = lse.dim() == 4  # [B, H, L, 1] on some versions; the backward wants it back so
    return res[0], lse[..., 0] if lse.dim() == 4 else lse


def _cudnn_bwd(do, q, k, v, out, lse, causal, scale):
    L = q.shape[2]
    seed, offset = _rng("cudnn", q.device)
    if _CUDNN_LSE_4D.get(str(q.device), True):
        lse = lse[..., None]
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default(
        do, q, k, v, out, lse, seed, offset, None, None, None, L, L, 0.0, causal, scale=scale)


@dataclass(frozen=True)
class Kernel:
    """A fused attention kernel: ``fwd(q, k, v, causal, scale) -> (out, lse [.., L] float32)`` and
    ``bwd(do, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` (any given ``out`` and ``lse``)."""

    name: str
    fwd: object
    bwd: object


_FLASH_CPU = Kernel("flash_attention_for_cpu", _flash_cpu_fwd, _flash_cpu_bwd)
_FLASH_CUDA = Kernel("flash_attention", _flash_cuda_fwd, _flash_cuda_bwd)
_EFFICIENT = Kernel("efficient_attention", _efficient_fwd, _efficient_bwd)
_CUDNN = Kernel("cudnn_attention", _cudnn_fwd, _cudnn_bwd)


def _candidates(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[Kernel]:
    """The kernels that may run ``dtype`` at ``head_dim`` on ``device``, fastest first."""
    if device.type == "cpu":
        return [_FLASH_CPU]
    if device.type != "cuda":
        return []
    out = []
    if dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256:
        out += [_CUDNN, _FLASH_CUDA]  # cuDNN: about 1.8x flash on Hopper (benchmarks/results, bench_attention)
    # The memory-efficient kernel past head dim 256 in half precision (the lse-gradient columns of D = 256) gave wrong
    # dq / dk on an H100 (torch 2.11) at bucket shapes where the probe's call was right: not used there.
    if head_dim % (8 if dtype in _HALF else 4) == 0 and (head_dim <= 256 or dtype == torch.float32):
        out.append(_EFFICIENT)
    return out


@lru_cache(maxsize=None)
def _probe(kernel: Kernel, device: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """``None`` when ``kernel`` runs here at ``head_dim`` and does what this module relies on, checked against float64
    math on a tiny causal call: the forward's out and lse, and a backward given *another* output and lse (as the
    merged ones are), which must use them as given: ``P = exp(S - lse)``, ``dS = P (dO V^T - rowsum(dO * out))``.
    Else why not (missing op, changed signature, other semantics)."""
    with torch.inference_mode(False), torch.no_grad():  # the caller may be under inference_mode
        try:
            return _probe_call(kernel, device, dtype, head_dim)
        except Exception as err:  # noqa: BLE001  (any failure of a private op means: do not use it)
            first = (str(err).splitlines() or [""])[0]
            return (f"aten {kernel.name} unavailable on {device} {dtype} head dim {head_dim}: "
                    f"{type(err).__name__}: {first}")


def _probe_call(kernel: Kernel, device: str, dtype: torch.dtype, head_dim: int) -> str | None:
    g = torch.Generator().manual_seed(0)
    n, scale = 150, 0.3  # more rows than one tile of any of the kernels: their tiling is part of what is checked
    x = [torch.randn(2, 2, n, head_dim, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(5)]
    q, k, v, do, other = x
    out, lse = kernel.fwd(q, k, v, True, scale)
    shift = torch.linspace(0.2, 1.0, n, dtype=torch.float32, device=q.device)  # as if other branches added mass
    out_m = (0.5 * out.double() + 0.5 * other.double()).to(dtype)
    lse_m = (lse.float() + shift).contiguous()
    dq, dk, dv = kernel.bwd(do, q, k, v, out_m, lse_m, True, scale)
    q64, k64, v64, do64, out_m64 = (t.double().cpu() for t in (q, k, v, do, out_m))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    want_lse = torch.logsumexp(s, -1)
    want_out = torch.softmax(s, -1) @ v64
    p = torch.exp(s - lse_m.double().cpu()[..., None])
    ds = p * (do64 @ v64.transpose(-1, -2) - (do64 * out_m64).sum(-1, keepdim=True))
    want = (want_out, want_lse, scale * ds @ k64, scale * ds.transpose(-1, -2) @ q64, p.transpose(-1, -2) @ do64)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        if tuple(got.shape) != tuple(ref.shape):
            return f"aten {kernel.name} on {device} {dtype}: {name} has shape {tuple(got.shape)} not {tuple(ref.shape)}"
        err = float((got.cpu().double() - ref).norm() / ref.norm())
        if not err < tol:
            return f"aten {kernel.name} on {device} {dtype}: {name} differs from what is relied on (rel err {err:.2e})"
    return None


def kernel_report(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict:
    """For benchmarks and bug reports: the kernel this path uses here, and why each faster candidate was skipped."""
    kernel, _ = kernel_for(device, dtype, head_dim)
    skipped = [why for c in _candidates(device, dtype, head_dim) if (why := _probe(c, str(device), dtype, head_dim))]
    return dict(kernel=None if kernel is None else kernel.name, skipped=skipped)


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[Kernel | None, str | None]:
    """The first candidate kernel that passes its probe, or ``(None, why none does)``."""
    reasons = []
    for kernel in _candidates(device, dtype, head_dim):
        why = _probe(kernel, str(device), dtype, head_dim)
        if why is None:
            return kernel, None
        reasons.append(why)
    if not reasons:
        return None, f"no fused attention kernel for {device.type} {dtype} at head dim {head_dim}"
    return None, "; ".join(reasons)


# ---------------------------------------------------------------------------------------------------------------
# Which calls this path takes.


_PADDING_KINDS = _IdentityMemo(size=4)  # every layer of a forward shares the layout: one host sync per forward


def _padding_kind(layout: TokenLayout) -> str:
    """``"none"`` when every row is one sequence at positions ``0..N-1`` in columns ``0..N-1``; ``"right"`` /
    ``"left"`` when each row is one sequence at positions ``0..n-1`` with all its padding after / before it;
    ``"other"`` else. One host sync (memoized per layout)."""
    fields = (layout.q_pos, layout.q_seq, layout.k_pos, layout.k_seq, layout.k_valid, layout.q_valid)

    def check() -> str:
        valid = layout.k_valid
        cols = torch.arange(valid.shape[1], device=valid.device)
        first = (~valid).sum(1, keepdim=True)  # the padding before a left-padded row's first real token
        one = torch.stack([(layout.k_seq == 0).all(), (layout.q_seq == 0).all(), (layout.q_valid == valid).all()])
        right = (valid[:, 1:] <= valid[:, :-1]).all() & ((layout.k_pos == cols) | ~valid).all()
        left = (valid[:, 1:] >= valid[:, :-1]).all() & ((layout.k_pos == cols - first) | ~valid).all()
        flags = torch.stack([one.all(), valid.all(), right, left]).tolist()
        if not flags[0]:
            return "other"
        return "none" if flags[1] and flags[2] else "right" if flags[2] else "left" if flags[3] else "other"

    return _PADDING_KINDS(check, fields, ())


def route(query, key, value, layout: TokenLayout, is_causal: bool, *, window,
          dropout_p) -> tuple[str | None, torch.Tensor | None, torch.Tensor | None]:
    """``(None, valid, shift)`` when the call's branches can run here exactly, else ``(why it runs tiled, None,
    None)``. ``valid``: the ``[B, N]`` real tokens of a padded causal batch (``None`` when nothing is padding);
    ``shift``: ``[B]`` padding columns before each row's tokens (left padding: the rows are rotated to right padding),
    or ``None``. Global tokens are the caller's: one more branch, merged by lse."""
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype} (the tiled path is the float64 oracle's twin)", None, None
    if query.shape[-1] != value.shape[-1]:
        return f"value head dim {value.shape[-1]} differs from the query's {query.shape[-1]}", None, None
    if dropout_p:
        return "dropout (the fused kernels draw their own mask, not SPEC's counter-based one)", None, None
    if window is not None:
        return "sliding window", None, None
    if query.shape[2] != key.shape[2]:
        return "fewer queries than keys (decoding against a cache)", None, None
    valid = shift = None
    if not layout.contiguous:
        kind = "other" if torch.compiler.is_compiling() else _padding_kind(layout)
        if kind == "other" or (kind != "none" and not is_causal):
            return ("layout with padding in the middle, packed sequences, positions other than 0..n-1, or (not "
                    "causal) any padding"), None, None
        if kind != "none":
            valid = layout.k_valid  # causal: a real query never reaches the padding after it
        if kind == "left":
            shift = (~valid).sum(1)
    if query.requires_grad or key.requires_grad or value.requires_grad:
        kernel, why = kernel_for(query.device, query.dtype, _padded_dim(query.shape[-1], query.device))
        if kernel is None:
            return f"backward through the lse: {why}", None, None
    why = kernel_for(query.device, query.dtype, query.shape[-1])[1]
    return (why, None, None) if why else (None, valid, shift)


def _padded_dim(d: int, device: torch.device) -> int:
    """Head dim with room for the two lse-gradient columns (a multiple of 8 on CUDA, for the kernels' alignment)."""
    return d + 2 if device.type == "cpu" else -(-(d + 2) // 8) * 8


# ---------------------------------------------------------------------------------------------------------------
# The plan: which rows of which heads form the buckets of each branch.


@dataclass(frozen=True)
class Group:
    """One fused call: ``segments`` buckets of ``length`` rows for each of the heads ``heads``.

    ``q_index`` / ``kv_index`` (``[segments, heads, length]`` flattened): row ``head * N + column`` of the
    ``[B, H * N, D]`` view of the queries and of the keys / values (the query head's kv head). ``cols``: the columns."""

    heads: torch.Tensor  # [Hg] query heads
    kv_heads: torch.Tensor  # [Hg]
    cols: torch.Tensor  # [S, Hg, L]: columns s w + o_h + j r
    q_index: torch.Tensor  # [S * Hg * L]
    kv_index: torch.Tensor  # [S * Hg * L]
    segments: int
    length: int
    fresh: bool  # no earlier group wrote these query rows (the first branch): no merge
    identity: bool  # the rows are all of [Hq * N] in order: q itself (and k, v without GQA) need no gather


def _group(heads: list[int], offsets: list[int], starts: list[int], length: int, r: int, group: int, N: int,
           device, fresh: bool) -> Group:
    h = torch.tensor(heads, device=device)
    o = torch.tensor(offsets, device=device)
    s = torch.tensor(starts, device=device)
    cols = s[:, None, None] + o[None, :, None] + r * torch.arange(length, device=device)[None, None, :]
    kv = torch.div(h, group, rounding_mode="floor")
    q_index = (h[None, :, None] * N + cols).flatten()
    kv_index = (kv[None, :, None] * N + cols).flatten()
    identity = starts == [0] and r == 1 and length == N  # r = 1: every head, in order
    return Group(h, kv, cols, q_index, kv_index, len(starts), length, fresh, identity)


@lru_cache(maxsize=4)  # index tensors of a few layer shapes (O(H N) each), kept on the device
def plan(branches: tuple, N: int, Hq: int, Hk: int, head_offset: int, device: str) -> tuple[Group, ...]:
    """Every fused call of one layer shape: per branch, its full segments (all heads) and its last, shorter one."""
    group = Hq // Hk
    out = []
    for i, (w, r) in enumerate(branches):
        w = min(w, -(-N // r) * r)  # a segment past the sequence's end is cut short: the same as one of N rounded up
        offsets = [(h + head_offset) % r for h in range(Hq)]
        full = N // w
        if full:
            out.append(_group(list(range(Hq)), offsets, [s * w for s in range(full)], w // r, r, group, N, device,
                              i == 0))
        tail = N - full * w
        by_count: dict[int, list[int]] = {}
        for h, o in enumerate(offsets):
            count = max(0, -(-(tail - o) // r))
            if count:
                by_count.setdefault(count, []).append(h)
        for count, heads in sorted(by_count.items()):
            out.append(_group(heads, [offsets[h] for h in heads], [full * w], count, r, group, N, device, i == 0))
    return tuple(out)


def _gather(x: torch.Tensor, heads: torch.Tensor, g: Group) -> torch.Tensor:
    """``x [B, H, N, D]`` at the group's rows as buckets ``[B * S, Hg, L, D]`` (any strides)."""
    B = x.shape[0]
    if g.identity and x.shape[1] == heads.numel():
        return x  # all rows in order (q, out, dO; k and v without GQA)
    return x[:, heads[None, :, None], g.cols].reshape(B * g.segments, g.heads.numel(), g.length, x.shape[-1])


def _rows(flat: torch.Tensor, g: Group) -> torch.Tensor:
    """A contiguous per-row tensor ``[B, Hq * N]`` at the group's query rows, as ``[B * S, Hg, L]``."""
    return flat[:, g.q_index].view(flat.shape[0] * g.segments, g.heads.numel(), g.length)


# ---------------------------------------------------------------------------------------------------------------
# Forward, backward, autograd.


def _forward(q, k, v, groups, kernel: Kernel, causal: bool, scale: float):
    """Merged ``(out [B, Hq, N, D] in q's dtype, lse [B, Hq, N] float32)``."""
    B, Hq, N, D = q.shape
    acc = torch.zeros(B, Hq * N, D, dtype=torch.float32, device=q.device)
    lse_all = torch.full((B, Hq * N), -math.inf, dtype=torch.float32, device=q.device)
    for g in groups:
        o, lse = kernel.fwd(_gather(q, g.heads, g), _gather(k, g.kv_heads, g), _gather(v, g.kv_heads, g), causal,
                            scale)
        lse = lse.float().reshape(B, -1)
        if g.identity and len(groups) == 1:  # one dense bucket: the kernel's output is the answer
            return o.to(q.dtype), lse.view(B, Hq, N)
        if g.fresh:
            acc[:, g.q_index] = o.reshape(B, -1, D).float()
            lse_all[:, g.q_index] = lse
        else:
            old = lse_all[:, g.q_index]
            new = torch.logaddexp(old, lse)  # every selected query sees at least itself: lse is finite
            merged = acc[:, g.q_index].mul_(torch.exp(old - new)[..., None])
            merged.add_(o.reshape(B, -1, D).float().mul_(torch.exp(lse - new)[..., None]))
            acc[:, g.q_index] = merged
            lse_all[:, g.q_index] = new
            del old, new, merged
        del o, lse  # free this group's results before the next group's
    return acc.view(B, Hq, N, D).to(q.dtype), lse_all.view(B, Hq, N)


def _backward(dout, dlse, q, k, v, out, lse, groups, kernel: Kernel, causal: bool, scale: float):
    B, Hq, N, D = q.shape
    Hk = k.shape[1]
    single = len(groups) == 1 and groups[0].identity and Hq == Hk  # one dense bucket: the kernel's grads as they are
    if not single:
        dq = torch.zeros(B, Hq * N, D, dtype=torch.float32, device=q.device)
        dk = torch.zeros(B, Hk * N, D, dtype=torch.float32, device=q.device)
        dv = torch.zeros(B, Hk * N, D, dtype=torch.float32, device=q.device)
    lse_flat = lse.reshape(B, Hq * N)
    pad = 0
    if dlse is not None:
        pad = _padded_dim(D, q.device) - D
        dlse_flat = dlse.float().reshape(B, Hq * N)
    for g in groups:
        Q, K, V = _gather(q, g.heads, g), _gather(k, g.kv_heads, g), _gather(v, g.kv_heads, g)
        O, dO = _gather(out, g.heads, g), _gather(dout, g.heads, g)
        L = _rows(lse_flat, g)
        if pad:  # the lse gradient in two more columns (high and low part in q's dtype): delta' = rowsum(dO O) - dL
            Q, K, V, O, dO = (F.pad(t, (0, pad)) for t in (Q, K, V, O, dO))
            dl = _rows(dlse_flat, g)
            hi = dl.to(O.dtype)
            O[..., D], O[..., D + 1] = -1, -1
            dO[..., D], dO[..., D + 1] = hi, (dl - hi.float()).to(O.dtype)
            del dl, hi
        gq, gk, gv = kernel.bwd(dO.contiguous(), Q, K, V, O.contiguous(), L.contiguous(), causal, scale)
        del Q, K, V, O, dO, L  # free this group's gathers before the next group's
        if single:
            return gq[..., :D].to(q.dtype), gk[..., :D].to(k.dtype), gv[..., :D].to(v.dtype)
        n = g.q_index.numel()
        for acc, grad, index in ((dq, gq, g.q_index), (dk, gk, g.kv_index), (dv, gv, g.kv_index)):
            acc.index_add_(1, index, grad[..., :D].reshape(B, n, D).float())
        del gq, gk, gv, grad
    return (dq.view(B, Hq, N, D).to(q.dtype), dk.view(B, Hk, N, D).to(k.dtype), dv.view(B, Hk, N, D).to(v.dtype))


class _BucketedAttention(torch.autograd.Function):
    """Forward and exact backward on the fused kernels; saves q, k, v, the merged output and lse (O(N)).
    ``setup_context`` style, so ``torch.func`` transforms (the Triton op's fallback vjp) can run it."""

    @staticmethod
    def forward(q, k, v, groups, kernel, causal, scale, valid):
        out, lse = _forward(q, k, v, groups, kernel, causal, scale)
        if valid is not None:  # padding rows give 0 and lse -inf, as the tiled path (a fill: 0 * NaN would be NaN)
            out = out.masked_fill(~valid[:, None, :, None], 0)
            lse = lse.masked_fill(~valid[:, None, :], -math.inf)
        return out, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, groups, kernel, causal, scale, valid = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (groups, kernel, causal, scale, valid)
        ctx.set_materialize_grads(False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        groups, kernel, causal, scale, valid = ctx.params
        if dout is None:
            dout = torch.zeros_like(out)
        if valid is not None:  # the padding rows' outputs are constants: nothing flows back from them
            rows = ~valid[:, None, :]
            dout = dout.masked_fill(rows[..., None], 0)
            dlse = None if dlse is None else dlse.masked_fill(rows, 0)
            lse = lse.masked_fill(rows, math.inf)  # P = exp(S - inf) = 0 on padding rows: no 0 * inf
        if dlse is not None:  # the lse-gradient columns need a kernel at the padded head dim
            kernel, why = kernel_for(q.device, q.dtype, _padded_dim(q.shape[-1], q.device))
            if kernel is None:  # route() checked this before the forward ran
                raise RuntimeError(f"no fused kernel for the lse gradient: {why}")
        dq, dk, dv = _backward(dout, dlse, q, k, v, out, lse, groups, kernel, causal, scale)
        return dq, dk, dv, None, None, None, None, None


def _rotate(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Each row ``b`` of ``x [B, H, N, ...]`` rotated ``shift[b]`` columns to the left (differentiable)."""
    B, H, N = x.shape[:3]
    index = (torch.arange(N, device=x.device) + shift[:, None]) % N
    return x.gather(2, index.view(B, 1, N, *([1] * (x.ndim - 3))).expand(x.shape))


def bucketed_attention(query, key, value, branches, is_causal: bool, scale: float, head_offset: int = 0,
                       valid: torch.Tensor | None = None, shift: torch.Tensor | None = None):
    """Dilated attention on a plain, or right- or left-padded causal, layout (see :func:`route`):
    ``(out, lse float32)``. Left padding: the rows are rotated to right padding and the results back."""
    B, Hq, N, D = query.shape
    kernel, why = kernel_for(query.device, query.dtype, D)
    if kernel is None:
        raise ValueError(f"no fused attention kernel for this call: {why}")
    groups = plan(tuple(branches), N, Hq, key.shape[1], head_offset, str(query.device))
    if shift is not None:
        query, key, value, valid = (_rotate(t, shift) for t in (query, key, value, valid[:, None]))
        valid = valid[:, 0]
    if valid is not None:  # padding is never attended (SPEC), but the kernels multiply its rows by 0 (P V, and dS K /
        # dS^T Q in the backward), which is NaN for a NaN there: the padding rows of q, k and v read as 0
        query, key, value = (t.masked_fill(~valid[:, None, :, None], 0) for t in (query, key, value))
    out, lse = _BucketedAttention.apply(query, key, value, groups, kernel, bool(is_causal), float(scale), valid)
    if shift is not None:
        out, lse = _rotate(out, N - shift), _rotate(lse, N - shift)
    return out, lse
