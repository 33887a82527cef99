"""Property tests: random configurations, shapes, masks, packing, GQA ratios, dtypes, head dims, windows, global
tokens and dropout, each backend against the float64 statement of SPEC.md (tests/naive.py): outputs, lse and the
gradients of q, k, v through both. ``build_case`` draws a case from any chooser (hypothesis here, a seeded
``random.Random`` in ``scripts/property_check.py`` for the long run), so both explore the same space.

Layouts are built directly as ``TokenLayout`` (one sequence per row unless packed; a masked key hides that key only),
so these tests check the backends, not how ``resolve_layout`` reads a mask.
"""

from __future__ import annotations

import inspect
import os
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_dilated.config import DENSE_SEGMENT
from hf_dilated.ops.layout import TokenLayout
from hf_dilated.ops.reference import dilated_attention_reference
from test_reference import check_backend

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}
TRITON_TOL = {torch.float64: 1e-10, torch.float32: 1e-3, torch.bfloat16: 1e-2}  # fp32 dots may run in tf32


class RandomChooser:
    """The chooser interface over ``random.Random`` (the long run)."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def choice(self, options):
        return self.r.choice(list(options))


class HypothesisChooser:
    """The chooser interface over hypothesis' ``data.draw`` (shrinks failures to a minimal case)."""

    def __init__(self, data):
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options):
        return self.data.draw(st.sampled_from(list(options)))


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    branches: tuple
    layout: TokenLayout
    is_causal: bool
    head_offset: int
    window: int | None
    global_tokens: int
    dropout_p: float
    seed: torch.Tensor | None
    description: str
    rng_seed: int = 0  # seeds torch's global generator for the check's upstream gradients (exact replays)


def _branches(pick) -> tuple:
    kind = pick.choice(["dilated", "dilated", "dilated", "dense", "window"])
    if kind != "dilated":
        return ((DENSE_SEGMENT, 1),), kind
    ws = sorted(pick.int(1, 24) for _ in range(pick.int(1, 3)))
    rs = [pick.choice([r for r in range(1, 9) if w % r == 0]) for w in ws]
    rs[pick.int(0, len(rs) - 1)] = 1  # at least one branch of rate 1
    return tuple(zip(ws, rs)), kind


def _mask_layout(pick, B: int, Nq: int, Nk: int) -> tuple[TokenLayout, str]:
    """Key validity, positions and sequences of one of: no mask, left / right padding, holes in the middle, whole
    rows masked, packed sequences (positions restarting, optionally right-padded)."""
    kind = pick.choice(["none", "left", "right", "holes", "rows", "packed"])
    valid = torch.ones(B, Nk, dtype=torch.bool)
    seq = torch.zeros(B, Nk, dtype=torch.long)
    cols = torch.arange(Nk).expand(B, Nk).clone()
    pos = None
    for b in range(B):
        if kind == "left":
            valid[b, : pick.int(0, Nk)] = False
        elif kind == "right":
            valid[b, Nk - pick.int(0, Nk) :] = False
        elif kind == "holes":
            for _ in range(pick.int(1, 4)):
                valid[b, pick.int(0, Nk - 1)] = False
        elif kind == "rows" and pick.choice([True, False]):
            valid[b] = False
        elif kind == "packed":
            pos = torch.zeros(B, Nk, dtype=torch.long) if pos is None else pos
            n, s = 0, 0
            while n < Nk:
                length = pick.int(1, Nk - n)
                pos[b, n : n + length] = torch.arange(length)
                seq[b, n : n + length] = s
                n, s = n + length, s + 1
            valid[b, Nk - pick.int(0, 2) :] = False
    if pos is None:  # counted from the first real token (Transformers' position_ids), or the column index
        counted = (valid.long().cumsum(-1) - 1).clamp_min(0)
        pos = counted if pick.choice([True, False]) else cols
    layout = TokenLayout(pos[:, Nk - Nq :], seq[:, Nk - Nq :], pos, seq, valid, valid[:, Nk - Nq :].clone(), False)
    return layout, kind


def build_case(pick) -> Case:
    """One random call of a backend: every argument drawn from ``pick``."""
    dtype = pick.choice([torch.float64, torch.float32, torch.bfloat16])
    B, Hk, group = pick.int(1, 3), pick.int(1, 3), pick.int(1, 3)
    D = pick.int(1, 32) if pick.choice([True, True, False]) else pick.int(1, 256)
    Nk = pick.int(1, 40)
    Nq = Nk if pick.choice([True, True, False]) else pick.int(1, Nk)  # else: decoding / chunked prefill
    branches, kind = _branches(pick)
    layout, mask = _mask_layout(pick, B, Nq, Nk)
    window = pick.int(1, 12) if kind == "window" or pick.choice([False] * 5 + [True]) else None
    global_tokens = pick.choice([0, 0, 0, 1, 2, 5])
    dropout_p = pick.choice([0.0, 0.0, 0.0, 0.2, 0.6])
    seed = torch.tensor(pick.int(0, 2**62)) if dropout_p else None
    rng_seed = pick.int(0, 2**62)
    gen = torch.Generator().manual_seed(rng_seed)
    q, k, v = (torch.randn(B, h, n, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
               for h, n in ((Hk * group, Nq), (Hk, Nk), (Hk, Nk)))
    case = Case(q, k, v, branches, layout, pick.choice([True, False]), pick.int(0, 5), window, global_tokens,
                dropout_p, seed, "", rng_seed)
    case.description = (
        f"dtype={dtype} B={B} Hq={Hk * group} Hk={Hk} D={D} Nq={Nq} Nk={Nk} layer={kind} decode={Nq < Nk} "
        f"branches={branches} mask={mask} "
        f"causal={case.is_causal} head_offset={case.head_offset} window={window} global_tokens={global_tokens} "
        f"dropout_p={dropout_p}"
    )
    return case


def check_case(fn, case: Case, tol: dict) -> None:
    """The backend against the float64 oracle (``check_backend`` asserts outputs, lse and every gradient), and an
    output of the right shape with no NaN or inf anywhere, padding rows included."""
    torch.manual_seed(case.rng_seed)
    out, _ = check_backend(fn, case.q, case.k, case.v, case.branches, case.layout, tol[case.q.dtype],
                           is_causal=case.is_causal, head_offset=case.head_offset, window=case.window,
                           global_tokens=case.global_tokens, dropout_p=case.dropout_p, seed=case.seed)
    assert out.shape == case.q.shape[:3] + (case.v.shape[-1],)
    assert torch.isfinite(out).all(), "NaN or inf in the output"


PROPERTY = settings(max_examples=int(os.environ.get("HF_DILATED_PROPERTY_EXAMPLES", 40)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@PROPERTY
@given(st.data())
def test_reference_matches_the_spec(data):
    case = build_case(HypothesisChooser(data))
    check_case(dilated_attention_reference, case, TOL)


def _triton():
    """The Triton backend function when it can run here (CUDA, or the CPU interpreter), else None."""
    try:
        from hf_dilated.ops import triton as triton_backend
    except ImportError:
        return None
    if not triton_backend.is_available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        return None
    return triton_backend.dilated_attention_triton


def _supported(fn, case: Case) -> bool:
    """Whether ``fn`` takes every keyword this case needs (the kernels gain window / globals / dropout over time)."""
    params = inspect.signature(fn).parameters
    needed = {"window": case.window is not None, "global_tokens": case.global_tokens > 0,
              "dropout_p": case.dropout_p > 0}
    return all(name in params for name, used in needed.items() if used)


@pytest.mark.skipif(_triton() is None, reason="Triton cannot run here")
@settings(PROPERTY, max_examples=int(os.environ.get("HF_DILATED_PROPERTY_TRITON_EXAMPLES", 4)))
@given(st.data())
def test_triton_matches_the_spec(data):
    fn = _triton()
    case = build_case(HypothesisChooser(data))
    if not _supported(fn, case):
        case.window, case.global_tokens, case.dropout_p, case.seed = None, 0, 0.0, None
    if case.q.dtype == torch.float64:  # the kernels run float32 / half types (float64 is the reference's)
        case.q, case.k, case.v = (t.detach().float().requires_grad_() for t in (case.q, case.k, case.v))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        case.q, case.k, case.v = (t.detach().cuda().requires_grad_() for t in (case.q, case.k, case.v))
        case.layout = TokenLayout(*(t.cuda() for t in (case.layout.q_pos, case.layout.q_seq, case.layout.k_pos,
                                                       case.layout.k_seq, case.layout.k_valid,
                                                       case.layout.q_valid)), False)

    def call(q, k, v, branches, layout, is_causal, scale, head_offset, **kwargs):
        kwargs = {name: value for name, value in kwargs.items() if name in inspect.signature(fn).parameters}
        return fn(q, k, v, branches, layout, is_causal, scale, head_offset, **kwargs)

    check_case(call, case, TRITON_TOL)
