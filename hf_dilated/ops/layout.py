"""TokenLayout: where each query and key sits (sequence, position, padding), resolved once per call.

SPEC.md defines everything by a token's *position* ``p`` (its index within its own sequence) and its sequence,
not by its column in the tensor. This module turns what callers pass (a 2-D key padding mask, ``position_ids``,
flash-style ``cu_seqlens``, or a static cache's filled length) into one compact description that every backend reads:
O(B * N) integers, or, when queries decode against a cache whose keys sit in order, O(B * Nq) integers and three per
row (the per-key tensors are then built only if a backend asks for them).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch


class TokenLayout:
    """Per-token metadata of one attention call.

    Attributes:
        q_pos, q_seq: ``[B, Nq]`` int64 position and sequence id of each query.
        k_pos, k_seq: ``[B, Nk]`` int64 position and sequence id of each key.
        k_valid: ``[B, Nk]`` bool, False for padding / unfilled cache slots (never attended).
        q_valid: ``[B, Nq]`` bool, False for padding queries (their output is zero, never NaN).
        contiguous: True when no token is padding, there is one sequence per row, keys sit at positions
            ``0..Nk-1`` in order and the queries are the last ``Nq`` of them. Kernels take a fast path then.
        keys: ``None``, or for queries decoding against a cache (one sequence per row) ``[B, 3]`` int64
            ``(base, lo, hi)``: the key at position ``p`` sits at column ``base + p``, and the real keys are the
            positions ``[lo, hi)``; every other column is unfilled. Built from the cache length and the queries'
            positions only (:func:`cache_layout`): ``k_pos``, ``k_seq``, ``k_valid`` and ``contiguous`` are then
            computed on first use (``O(B * Nk)``), so a decoding kernel that reads ``keys`` costs nothing per key.
    """

    def __init__(self, q_pos: torch.Tensor, q_seq: torch.Tensor, k_pos: torch.Tensor | None,
                 k_seq: torch.Tensor | None, k_valid: torch.Tensor | None, q_valid: torch.Tensor,
                 contiguous: bool | None, keys: torch.Tensor | None = None, n_keys: int | None = None):
        if k_pos is None and (keys is None or n_keys is None):
            raise ValueError("a TokenLayout needs its keys' positions, or keys=(base, lo, hi) and n_keys")
        self.q_pos, self.q_seq, self.q_valid = q_pos, q_seq, q_valid
        self._k_pos, self._k_seq, self._k_valid, self._contiguous = k_pos, k_seq, k_valid, contiguous
        self.keys = keys
        self.n_keys = int(n_keys if n_keys is not None else k_pos.shape[1])

    def __repr__(self) -> str:
        form = "cache keys" if self.keys is not None else "per-token keys"
        return f"TokenLayout(B={self.batch_size}, Nq={self.q_pos.shape[1]}, Nk={self.n_keys}, {form})"

    @property
    def batch_size(self) -> int:
        return self.q_pos.shape[0]

    def _materialize(self) -> None:
        base, lo, hi = (x[:, None] for x in self.keys.unbind(1))
        pos = torch.arange(self.n_keys, device=self.keys.device)[None] - base
        self._k_valid = (pos >= lo) & (pos < hi)
        self._k_pos = torch.where(self._k_valid, pos, torch.zeros_like(pos))
        self._k_seq = torch.zeros_like(self._k_pos)

    @property
    def k_pos(self) -> torch.Tensor:
        if self._k_pos is None:
            self._materialize()
        return self._k_pos

    @property
    def k_seq(self) -> torch.Tensor:
        if self._k_seq is None:
            self._materialize()
        return self._k_seq

    @property
    def k_valid(self) -> torch.Tensor:
        if self._k_valid is None:
            self._materialize()
        return self._k_valid

    @property
    def contiguous(self) -> bool:
        """For a cache layout decided on first use: one scalar read on the host (none while tracing: False)."""
        if self._contiguous is None:
            if torch.compiler.is_compiling():
                self._contiguous = False
            else:
                nq, nk = self.q_pos.shape[1], self.n_keys
                want = torch.tensor([0, 0, nk], device=self.keys.device)
                cols = torch.arange(nk - nq, nk, device=self.q_pos.device)
                self._contiguous = bool((self.keys == want).all() & (self.q_pos == cols).all())
        return self._contiguous


class _IdentityMemo:
    """Remembers a few recent results of a function of tensors, keyed by the tensors' identity and version.

    Every attention layer of one forward (and its recomputation under activation checkpointing) receives the same
    ``attention_mask`` / ``position_ids`` objects: resolving them once instead of per layer saves the host syncs
    that would otherwise stall the GPU queue at each layer. The entries hold the tensors, so an id cannot be reused
    while cached, and an in-place change bumps the version and misses.
    """

    def __init__(self, size: int = 2):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def __call__(self, fn: Callable[..., Any], tensors: tuple, extra: tuple) -> Any:
        if torch.compiler.is_compiling():
            return fn()
        try:
            key = (tuple([None if t is None else (id(t), t._version) for t in tensors]), extra)
        except RuntimeError:  # an inference tensor keeps no version counter: no safe key
            return fn()
        hit = self.entries.get(key)
        if hit is not None:  # (the entry holds its tensors: no other tensor can have their ids meanwhile)
            self.entries.move_to_end(key)
            return hit[1]
        value = fn()
        self.entries[key] = (tensors, value)
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


_LAYOUTS = _IdentityMemo()


def _sequence_ids_from_positions(pos: torch.Tensor) -> torch.Tensor:
    """A new sequence starts wherever the position does not follow the previous one (as Transformers detects packing)."""
    return (torch.diff(pos, prepend=pos[:, :1], dim=-1) != 1).cumsum(-1) - 1  # the first token starts sequence 0


def _normalize_position_ids(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    if position_ids.ndim == 3:  # multimodal RoPE (3, B, N): the first row is the text position
        position_ids = position_ids[0]
    if position_ids.ndim == 1:
        position_ids = position_ids[None]
    if position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must have shape [B, N] or [1, N], got {tuple(position_ids.shape)}")
    return position_ids.long().expand(batch, -1)


def _from_cu_seqlens(cu: torch.Tensor, n: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    cu = cu.long().flatten()
    checkable = not torch.compiler.is_compiling()  # values cannot be read while tracing
    if checkable and (cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any())):
        raise ValueError(f"{name} must be non-decreasing offsets from 0 to the packed length {n}, got {cu.tolist()}")
    cols = torch.arange(n, device=cu.device)
    seq = torch.searchsorted(cu, cols, right=True) - 1
    return (cols - cu[seq])[None], seq[None]


def _key_mask(attention_mask: torch.Tensor, batch: int, kv_len: int, device) -> torch.Tensor:
    """The 2-D key mask as booleans (True = a real key). Accepts bool and 0/1 integer masks; refuses float masks,
    whose meaning is ambiguous (a 0/1 keep-mask and an additive 0/-inf mask read oppositely)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch, kv_len):
        raise ValueError(
            f"attention_mask must be a 2-D key mask of shape [B, Nk] = [{batch}, {kv_len}], "
            f"got {tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}"
        )
    if attention_mask.dtype == torch.bool:
        return attention_mask.to(device)
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f"attention_mask must be a boolean or 0/1 integer key mask (True / 1 = attend to this key), got dtype "
            f"{attention_mask.dtype}; for an additive float mask (0 = keep, -inf = hide) pass `mask == 0`, for a 0/1 "
            "float mask pass `mask.bool()`"
        )
    if not torch.compiler.is_compiling() and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must be a boolean or 0/1 integer key mask; it holds values other than 0 and 1")
    return attention_mask.to(device) != 0


def _key_lengths(lengths: torch.Tensor, batch: int, kv_len: int, device) -> torch.Tensor:
    """A ``[B]`` (or one-element) integer tensor of key lengths as ``[B]`` int64 on ``device``, clamped to the keys."""
    if lengths.is_floating_point() or lengths.dtype == torch.bool or lengths.numel() not in (1, batch):
        raise ValueError(
            f"attention_mask must be a 2-D key mask [B, Nk] = [{batch}, {kv_len}] or a [B] integer tensor of key "
            f"lengths (the first lengths[b] columns are real keys), got shape {tuple(lengths.shape)}, {lengths.dtype}"
        )
    return lengths.to(device=device, dtype=torch.int64).reshape(-1).expand(batch).clamp(0, kv_len)


def key_mask_from_lengths(lengths: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The ``[B, Nk]`` boolean key mask of ``[B]`` key lengths (the first ``lengths[b]`` columns are real)."""
    return torch.arange(kv_len, device=lengths.device)[None] < lengths.reshape(-1, 1)


def cache_layout(batch: int, q_len: int, kv_len: int, device, lengths: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> TokenLayout:
    """The layout of ``q_len`` queries decoding against a cache of ``kv_len`` columns, from O(B * Nq) integers.

    Row ``b`` holds ``F = lengths[b]`` filled columns (all ``kv_len`` when ``lengths`` is None), one sequence in
    order. The queries' positions are ``position_ids`` (``[B, Nq]``), else the last ``Nq`` filled columns'. As SPEC.md
    says, the real keys end at the last query: the key in column ``c < F`` has position ``c + P + 1 - F`` where ``P``
    is the last query's position (keys that would fall below position 0 are not real), and unfilled columns are never
    attended. Nothing here reads a value on the host or builds a tensor with ``kv_len`` elements.
    """
    device = torch.device(device)
    if q_len > kv_len:
        raise ValueError(f"query length ({q_len}) must not exceed key length ({kv_len})")
    steps = torch.arange(q_len, device=device)
    if lengths is None:
        filled = torch.full((batch,), kv_len, dtype=torch.int64, device=device)
    else:
        filled = _key_lengths(lengths, batch, kv_len, device)
    if position_ids is not None:
        q_pos = _normalize_position_ids(position_ids.to(device), batch)
        if q_pos.shape[1] != q_len:
            raise ValueError(
                f"position_ids must cover the queries ({q_len}) or the keys ({kv_len}), got length {q_pos.shape[1]}"
            )
    else:
        q_pos = (filled[:, None] - q_len + steps[None]).clamp_min(0)
    last = q_pos[:, -1]
    base = filled - 1 - last
    keys = torch.stack([base, (-base).clamp_min(0), last + 1], 1)
    q_seq = torch.zeros_like(q_pos)
    q_valid = torch.ones_like(q_pos, dtype=torch.bool)
    contiguous = True if lengths is None and position_ids is None else None  # else decided on first use
    return TokenLayout(q_pos, q_seq, None, None, None, q_valid, contiguous, keys=keys, n_keys=kv_len)


def _masked_cache_layout(real: torch.Tensor, position_ids: torch.Tensor, q_len: int, batch: int) -> TokenLayout | None:
    """A cache layout for queries decoding against a 2-D masked cache (``generate()`` passes one), or ``None`` when
    some row's real keys are not one block of columns (holes in the middle: positions then do not step with the
    columns). Costs a few reductions over the mask and one scalar read on the host (memoized with the layout, so once
    per forward), instead of copying the per-key layout to the host."""
    q_pos = _normalize_position_ids(position_ids.to(real.device), batch)
    if q_pos.shape[1] != q_len:
        return None
    n_keys = real.shape[1]
    cols = torch.arange(n_keys, device=real.device)
    count = real.sum(-1)
    last = torch.where(real, cols, -1).amax(-1)
    first = torch.where(real, cols, n_keys).amin(-1)
    if not bool(((last - first + 1 == count) & (count > 0)).all()):
        return None
    base = last - q_pos[:, -1]  # the last real key is at the last query's position
    keys = torch.stack([base, (first - base).clamp_min(0), q_pos[:, -1] + 1], 1)
    return TokenLayout(q_pos, torch.zeros_like(q_pos), None, None, None, torch.ones_like(q_pos, dtype=torch.bool),
                       None, keys=keys, n_keys=n_keys)


def zero_padding(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: TokenLayout):
    """``query``, ``key``, ``value`` with their padding rows (``q_valid`` / ``k_valid`` False) set to 0: padding is never
    attended (SPEC.md), but a kernel that multiplies a padding row by 0 inside a tile (``P V``, and ``dS K`` /
    ``dS^T Q`` in the backward) turns a NaN there into NaN in real rows. The same tensors when nothing is padding or
    the keys are a cache's (decoding reads only filled slots). Differentiable: the padding rows get no gradient."""
    if layout.keys is not None or layout.contiguous:
        return query, key, value
    q_pad, k_pad = ~layout.q_valid[:, None, :, None], ~layout.k_valid[:, None, :, None]
    return query.masked_fill(q_pad, 0), key.masked_fill(k_pad, 0), value.masked_fill(k_pad, 0)


def resolve_layout(
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> TokenLayout:
    """Build the :class:`TokenLayout` of one call (memoized on the identity of its tensor arguments).

    Rules (SPEC.md, Transformers' own): ``attention_mask`` is a ``[B, Nk]`` key mask (bool, or 0/1 integers;
    True / 1 = real key). With a 2-D mask each row is ONE sequence and a 0 hides that key and nothing else (left,
    right or in the middle). Packed sequences (several per row) come from ``cu_seqlens_*`` (``B == 1``), or, only
    when no 2-D mask is given, from ``position_ids`` restarting. Positions are ``position_ids`` when given, else
    the count of real keys before the token, so left padding needs nothing more.
    With ``Nq < Nk`` (decoding against a cache) each row is one sequence; ``position_ids`` (``[B, Nq]``) give the
    queries' positions and the real keys end at the last query, else the queries are the last ``Nq`` keys.
    ``attention_mask`` may also be a ``[B]`` integer tensor of *key lengths* (what the mask function passes for a
    static cache): row ``b``'s real keys are its first ``lengths[b]`` columns, in order. Decoding without a 2-D mask
    gives a cache layout (:func:`cache_layout`): no per-key tensor is built, whatever the cache length.
    """
    tensors = (attention_mask, position_ids, cu_seqlens_q, cu_seqlens_k)
    shape = (batch, q_len, kv_len, str(torch.device(device)))
    return _LAYOUTS(lambda: _resolve_layout(batch, q_len, kv_len, device, *tensors), tensors, shape)


def _resolve_layout(batch, q_len, kv_len, device, attention_mask, position_ids, cu_seqlens_q, cu_seqlens_k) -> TokenLayout:
    if q_len > kv_len:
        raise ValueError(f"query length ({q_len}) must not exceed key length ({kv_len})")
    tracing = torch.compiler.is_compiling()
    lengths = None
    if attention_mask is not None and attention_mask.ndim == 1:
        lengths, attention_mask = _key_lengths(attention_mask, batch, kv_len, device), None
    no_packing = cu_seqlens_q is None and cu_seqlens_k is None
    if q_len < kv_len and attention_mask is None and no_packing:
        if position_ids is None or _normalize_position_ids(position_ids, batch).shape[1] != kv_len:
            return cache_layout(batch, q_len, kv_len, device, lengths, position_ids)
    if lengths is not None:
        attention_mask = key_mask_from_lengths(lengths, kv_len)
    masked = attention_mask is not None
    if masked and q_len < kv_len and no_packing and position_ids is not None and not tracing:
        layout = _masked_cache_layout(_key_mask(attention_mask, batch, kv_len, device), position_ids, q_len, batch)
        if layout is not None:
            return layout
    if masked:
        k_valid = _key_mask(attention_mask, batch, kv_len, device)
    else:
        k_valid = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    if position_ids is not None:
        position_ids = _normalize_position_ids(position_ids.to(device), batch)
        if position_ids.shape[1] not in (q_len, kv_len):
            raise ValueError(
                f"position_ids must cover the queries ({q_len}) or the keys ({kv_len}), got length {position_ids.shape[1]}"
            )
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        cu_seqlens_q = cu_seqlens_k if cu_seqlens_q is None else cu_seqlens_q

    if cu_seqlens_q is not None:
        if batch != 1 or q_len != kv_len:
            raise ValueError("cu_seqlens (packed sequences) need batch size 1 and equal query and key lengths")
        k_pos, k_seq = _from_cu_seqlens(cu_seqlens_k.to(device), kv_len, "cu_seqlens_k")
        q_pos, q_seq = _from_cu_seqlens(cu_seqlens_q.to(device), q_len, "cu_seqlens_q")
        if not tracing and not torch.equal(q_seq, k_seq):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same packed sequences")
        return TokenLayout(q_pos, q_seq, k_pos, k_seq, k_valid, k_valid.clone(), contiguous=False)

    # Positions of the keys: given, or counted real keys (a plain arange when nothing is masked: no cumsum).
    columns = torch.arange(kv_len, device=device).expand(batch, -1)
    counted = (k_valid.long().cumsum(-1) - 1).clamp_min(0) if masked else columns
    if q_len == kv_len:
        k_pos = position_ids if position_ids is not None else counted
        if position_ids is not None and not masked:
            k_seq = _sequence_ids_from_positions(k_pos)  # packed rows: a new sequence where positions restart
        else:
            k_seq = torch.zeros_like(k_pos)  # one sequence per row; masked keys are hidden, nothing more
        q_pos, q_seq, q_valid = k_pos, k_seq, k_valid
    else:
        if position_ids is not None and position_ids.shape[1] == kv_len:
            k_pos = position_ids
            q_pos = position_ids[:, kv_len - q_len :]
        elif position_ids is not None:
            # Queries' positions given: the real keys end at the last query (a cache appends before it attends), so
            # count them back from there. A cache holding only recent keys (sliding window) needs exactly this.
            q_pos = position_ids
            after = k_valid.long().flip(-1).cumsum(-1).flip(-1) if masked else kv_len - columns
            k_pos = (q_pos[:, -1:] + 1 - after).clamp_min(0)
        else:
            k_pos = counted
            q_pos = counted[:, kv_len - q_len :]
        k_seq = torch.zeros_like(k_pos)
        q_seq = torch.zeros_like(q_pos)
        q_valid = torch.ones_like(q_pos, dtype=torch.bool)
    return TokenLayout(q_pos, q_seq, k_pos, k_seq, k_valid, q_valid, _is_contiguous(
        k_valid, k_pos, q_pos, masked, position_ids, kv_len, q_len, tracing))


def _is_contiguous(k_valid, k_pos, q_pos, masked, position_ids, kv_len, q_len, tracing) -> bool:
    """Whether the kernels' fast path applies (see :class:`TokenLayout`). Decided from the arguments' structure where
    possible; otherwise at most one host sync of a scalar per call (never a copy of the layout to the host), and
    none while tracing, where only the structurally contiguous case (no mask, no ``position_ids``) is recognised."""
    if position_ids is None and not masked:
        return True  # keys 0..Nk-1, queries the last Nq of them, by construction
    if tracing:
        return False
    checks = []
    if masked:
        checks.append(k_valid.all())
    if position_ids is not None:
        if position_ids.shape[1] == kv_len:
            checks.append((k_pos == torch.arange(kv_len, device=k_pos.device)).all())
        else:  # queries' positions only (decoding): O(Nq) to check, keys are counted
            checks.append((q_pos == torch.arange(kv_len - q_len, kv_len, device=q_pos.device)).all())
    return bool(torch.stack(checks).all())
