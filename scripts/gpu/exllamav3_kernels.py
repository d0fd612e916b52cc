#!/usr/bin/env python3
"""exllamav3 1.6.5's own EXL3 kernels timed at bench/results/h200.md's shapes, for "exllamav3 1.6.5"
columns beside exl3-bench's (scripts/gpu/exllamav3_kernels.sh runs both in one device call and
scripts/gpu/side_by_side_kernels.py merges their JSON into one table).

    python3 exllamav3_kernels.py [--groups gemv,moe,gemm] [--only REGEX] [--json FILE] [--md FILE]
    python3 exllamav3_kernels.py --list [--groups ...] [--only ...]    the cases; no torch, no GPU

Cases are exl3-bench's (tools/exl3_bench/exl3_bench.cc), named as h200.md's rows: `gemv` its BenchGemv
(m = 1..64 at seven shapes, K = 2..4 at m = 1, 3INST/MUL1 at 4096x14336 m = 1, 8), `moe` its
BenchMoe layers at T = 1, 8, 16, 64 plus a GLM-4.5-Air layer (hidden 4096, 128 experts of 1408,
top-8, one shared expert; not in exl3-bench), `gemm` its BenchGemm prefill rows (m = 128..8192).

Weights: exl3-bench's own random layers bit for bit (trellis, suh, svh), generated on the GPU by a
port of benchutil::Rng / RandomLinear (tools/exl3_bench/random_exl3.h) with exl3-bench's seeds, in
exllamav3's layout, which is the project's (EXL3_FORMAT.md): trellis int16 [k/16, n/16, 16K], suh
fp16 [k], svh fp16 [n]; the codebook as exllamav3's mcg / mul1 flags. The
port is checked against the C++ on the CPU (tests/scripts/gpu/exllamav3_kernels_test.py) and the
torch copy against the numpy one at start-up here. MoE routing: exl3-bench's 8 routing sets (same
expert ids; weights rounded to fp16, which exllamav3 takes). Inputs x are torch.randn, not
exl3-bench's normals. SwiGLU limit 10 on every layer, as exl3-bench's. Linears take fp16 x and give
fp16 y (LinearEXL3's default), MoE layers fp16 x and fp32 y (exl3-bench: fp32 in and out).

Each path exllamav3 1.6.5 takes for the case is timed, calling its extension (exllamav3_ext; its
Python package is not imported) as its modules do:
- rows <= 144 (LinearEXL3.forward -> BC_LinearEXL3::run): `exl3_gemm` with exllamav3's own choice
  (its small-m GEMV heuristic, the int8-activation GEMV for MUL1 at m <= 2 while EXL3_INT8_GEMV is
  on, its default, else the autotuned GEMM; the kernel it took is recorded), `exl3_gemv` (the GEMV
  forced) where it is eligible and `exl3_gemm EXL3_GEMV=0` (the autotuned GEMM) where the choice
  was the GEMV;
- `gemm` cases, every row count: LinearEXL3.reconstruct_hgemm's dequantise + hgemm, unfused and
  fused (exllamav3's choice above 144 rows, the fused one from 1024); exl3_gemm is not timed above
  144 rows (its autotuner takes seconds per shape there; exllamav3 takes it there only with
  no_reconstruct);
- MoE, T <= 8 (BlockSparseMLP -> BC_BlockSparseMLP::run_bszN): `coop` = the shared expert as a
  one-expert exl3_moe_coop launch and the routed exl3_moe_coop (exllamav3's default), and
  `coop, shared chain` = the shared expert as BC_GatedMLP runs it (exl3_mgemm gate+up, silu_mul,
  exl3_gemm down; EXL3_MOE_SHARED_COOP=0);
- MoE, T > 8 (BlockSparseMLP.forward's fused tier): `fused` = its torch routing bookkeeping
  (argsort, counts, slot tables), exl3_moe, exl3_moe_gather, and the shared expert as
  GatedMLP.forward runs it (exl3_mgemm up to 32 rows, separate exl3_gemm above) added in. Two
  departures, both in exllamav3's favour: the expert counts come from scatter_add instead of
  torch.bincount (which reads a maximum back to the host, so no graph could hold it), and where
  T * top-k exceeds the fused tier's rows (128; 256 for MUL1) the slot tables the module builds on
  the host after a count read-back are built before timing.
The best path that passes the check is reported beside exllamav3's own choice.

Method, as exl3-bench's: CUDA events around replays of a CUDA graph of several calls (GEMV: one per
weight copy, as many copies as exceed 256 MiB (> 4x the L2), each with its own x and y; MoE: the 8
routing sets; prefill: one call), median of --reps replays after a warm-up call per path (which
also runs exllamav3's autotuner) and 3 untimed replays. Where a path cannot be captured its calls
are timed as eager launches instead (recorded as timing "eager").

Check: every path's output against dequantise-then-matmul from the same tensors: W_inner decoded
here (decode_inner: its own decoder, checked against tests/golden's vectors by the CPU test), the
Hadamard transforms and scales in fp32 (TF32 off): ||out - ref|| / ||ref|| (MoE: the first 4
tokens of routing set 0, with exllamav3's SwiGLU clamp: min(silu(g), limit) * clamp(u, +-limit),
where the project clamps g before the silu). A path over its tolerance is reported,
marked failed and never chosen as best.

Output: one JSON object per line in --json (a device record, then one per case, written as each
finishes), the Markdown table in --md (and on stdout). --budget-s stops starting new cases (the
rest are recorded as skipped) so the whole run fits a device call. Exit status 4: a path failed its
check (the table says which); 1: the run could not start.
"""

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

EXLLAMAV3_VERSION = "1.6.5"
START = time.monotonic()

# --- The cases (exl3-bench's) ---------------------------------------------------------------------

GEMV_SHAPES = ((4096, 14336), (14336, 4096), (4096, 2048), (2048, 4096), (5120, 2304), (4096, 4096),
               (5120, 5120))
GEMV_ROWS = (1, 2, 4, 8, 16, 32, 48, 64)
GEMM_ROWS = (128, 256, 512, 1024, 2048, 4096, 8192)
MOE_TOKENS = (1, 8, 16, 64)
MOE_ROUTING_SETS = 8
SWIGLU_LIMIT = 10.0
GROUPS = ("gemv", "moe", "gemm")

# exllamav3 1.6.5's thresholds (modules/quant/exl3.py, modules/block_sparse_mlp.py, util/backend.py)
AUTO_RECONSTRUCT_THRESHOLD = 144   # LinearEXL3: exl3_gemm up to this many rows, dequant + hgemm above
FUSED_RECONSTRUCT_ROWS = 1024      # reconstruct_hgemm: the fused (Hadamards folded in) dequant from here
MAX_BSZN = 8                       # BlockSparseMLP: exl3_moe_coop up to this many tokens
FUSED_ROWS = 128                   # fused tier's rows per expert (MOE_FUSED_ROWS)
FUSED_ROWS_WIDE = 256              # ... for MUL1, with its 32/64-row tiles (MOE_MTILE)
MTILE_T1 = 16                      # MUL1: experts above this many rows take a wider row tile
SHARED_MGEMM_MAX_ROWS = 32         # GatedMLP: fused gate+up exl3_mgemm up to this many rows

# Relative error a path may show against the reference: a few fp16 roundings; exllamav3's int8
# GEMV quantises the activations (~1 % RMS by its own account).
TOLERANCE = 1e-2
TOLERANCE_INT8 = 4e-2

P_GEMM = "exl3_gemm"
P_GEMV = "exl3_gemv"
P_GEMM_NO_GEMV = "exl3_gemm EXL3_GEMV=0"
P_RECON = "reconstruct+hgemm"
P_RECON_HAD = "reconstruct_had+hgemm"
P_COOP = "coop"
P_COOP_CHAIN = "coop, shared chain"
P_FUSED = "fused"
PATH_ORDER = (P_GEMM, P_GEMV, P_GEMM_NO_GEMV, P_RECON, P_RECON_HAD, P_COOP, P_COOP_CHAIN, P_FUSED)


@dataclass(frozen=True)
class MoeShape:
    model: str
    hidden: int
    inter: int
    experts: int
    topk: int
    shared_inter: int  # 0: no shared expert
    in_exl3_bench: bool = True


MOE_SHAPES = (
    MoeShape("GLM-5.3-Flash", 4096, 2048, 288, 8, 2048),
    MoeShape("DeepSeek-V4.1-Flash", 5120, 2304, 384, 6, 2304),
    MoeShape("Qwen3.8-Flash-Next", 2560, 640, 512, 10, 0),
    MoeShape("GLM-4.5-Air", 4096, 1408, 128, 8, 1408, in_exl3_bench=False),
)


def linear_case_name(m, k, n, K, codebook):
    return f"m={m} {k}\u00d7{n} K={K} {codebook.upper()}"


def moe_layer_name(model, K, codebook):
    return f"{model} K={K} {codebook.upper()}"


@dataclass(frozen=True)
class LinearCase:
    group: str  # "gemv" or "gemm"
    m: int
    k: int
    n: int
    K: int
    codebook: str
    seed: int  # exl3-bench's RandomLinear seed

    @property
    def name(self):
        return linear_case_name(self.m, self.k, self.n, self.K, self.codebook)

    @property
    def weight_key(self):
        return (self.k, self.n, self.K, self.codebook, self.seed)


@dataclass(frozen=True)
class MoeCase:
    shape: MoeShape
    K: int
    codebook: str
    T: int

    group = "moe"

    @property
    def layer(self):
        return moe_layer_name(self.shape.model, self.K, self.codebook)

    @property
    def name(self):
        return f"{self.layer} T={self.T}"

    @property
    def seed(self):  # exl3-bench's RandomMoeLayer seed
        return 11 + self.K


def gemv_cases():
    """BenchGemv's cases in its order."""
    out = []
    for m in GEMV_ROWS:
        for k, n in GEMV_SHAPES:
            for K in (2, 3, 4):
                for cb in ("mcg", "3inst", "mul1"):
                    if cb != "mcg" and not (K == 2 and (k, n) == (4096, 14336) and m in (1, 8)):
                        continue
                    if m != 1 and K != 2:
                        continue
                    out.append(LinearCase("gemv", m, k, n, K, cb, 100 + K))
    return out


def moe_cases():
    """BenchMoe's layers at each T in its order, then GLM-4.5-Air's."""
    out = []
    for s in MOE_SHAPES:
        for K in (2, 3, 4):
            for cb in ("mcg", "mul1"):
                if s.experts != 288 and (K != 2 or cb != "mcg"):
                    continue
                if cb == "mul1" and K != 2:
                    continue
                out.extend(MoeCase(s, K, cb, T) for T in MOE_TOKENS)
    return out


def gemm_cases():
    """BenchGemm's prefill rows."""
    return [LinearCase("gemm", m, 4096, 14336, K, "mcg", 500 + K) for K in (2, 4) for m in GEMM_ROWS]


def select_cases(groups, only=None):
    """The cases of the named groups (a list or a comma-separated string), in order, whose names
    match the regular expression `only` (anywhere)."""
    if isinstance(groups, str):
        groups = [g for g in groups.split(",") if g]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown group(s) {', '.join(unknown)}: choose from {', '.join(GROUPS)}")
    pattern = re.compile(only) if only else None
    by_group = {"gemv": gemv_cases, "moe": moe_cases, "gemm": gemm_cases}
    cases = [c for g in GROUPS if g in groups for c in by_group[g]()]
    return [c for c in cases if pattern is None or pattern.search(c.name)]


def gemv_eligible(m, k, n, K, codebook):
    """exl3_gemv's conditions at integer K (quant/exl3_gemv.cu, exl3_gemv_try_launch)."""
    return m <= 8 and 2 <= K <= 4 and (codebook != "3inst" or K == 4) and k % 128 == 0 and n % 128 == 0


def gemm_kernel_name(tag, codebook):
    """What exl3_gemm's return value says it launched (quant/exl3_gemm.cu)."""
    if tag == 90:
        return "GEMV"
    if tag == 0 and codebook == "mul1":
        return "int8 GEMV"
    return f"GEMM shape {tag}"


def linear_default_path(m):
    """The path LinearEXL3.forward takes for m rows."""
    if m <= AUTO_RECONSTRUCT_THRESHOLD:
        return P_GEMM
    return P_RECON_HAD if m >= FUSED_RECONSTRUCT_ROWS else P_RECON


def fused_host_tables(ids, experts, fused_rows):
    """The slot tables BlockSparseMLP.forward builds on the host when T * top-k exceeds the fused
    tier's rows: (slot base, first sorted assignment, kind) per expert plus a sentinel entry, and
    the number of experts the fused kernel runs. ids: the flat expert ids of one call. Every
    expert must fit the fused tier (the other tiers are not mirrored here)."""
    counts = [0] * (experts + 1)
    for e in ids:
        counts[e] += 1
    if max(counts) > fused_rows:
        raise ValueError(f"an expert gets {max(counts)} rows, over the fused tier's {fused_rows}")
    base, start, kind = [0] * (experts + 1), [0] * (experts + 1), [0] * (experts + 1)
    slots = 0
    for e in range(experts + 1):
        start[e] = start[e - 1] + counts[e - 1] if e else 0
        if e < experts and counts[e]:
            base[e], kind[e] = slots, 1
            slots += counts[e]
    return base, start, kind, sum(1 for c in counts[:experts] if c)


# --- exl3-bench's random layers: benchutil::Rng and RandomLinear -----------------------------------

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def rng_state(seed):
    return (seed * GOLDEN + 0x1234567) & MASK64


def _mix(z):
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


class Rng:
    """benchutil::Rng, one value at a time (Python integers)."""

    def __init__(self, seed):
        self.s = rng_state(seed)

    def next(self):
        self.s = (self.s + GOLDEN) & MASK64
        return _mix(self.s)

    def uniform(self):  # exact: a 24-bit integer over 2^24, as the float32 expression gives
        return (self.next() >> 40) / 16777216.0


def moe_routing(T, topk, experts, K, sets=MOE_ROUTING_SETS):
    """BenchMoe's routing sets: (ids[set][token][slot], weights[set][token][slot], mean number of
    distinct experts a set touches), from its Rng(T * 31 + K)."""
    rng = Rng(T * 31 + K)
    ids, weights, touched = [], [], 0
    for _ in range(sets):
        set_ids, set_w, distinct = [], [], set()
        for _ in range(T):
            chosen, w = [], []
            for _ in range(topk):
                e = rng.next() % experts
                while e in chosen:
                    e = rng.next() % experts
                chosen.append(e)
                distinct.add(e)
                w.append(rng.uniform())
            set_ids.append(chosen)
            set_w.append(w)
        ids.append(set_ids)
        weights.append(set_w)
        touched += len(distinct)
    return ids, weights, touched / sets


class NumpyOps:
    """The array operations the generator and the decoder use, on numpy."""

    def __init__(self):
        import numpy
        self.np = numpy

    def arange(self, a, b):
        return self.np.arange(a, b, dtype=self.np.int64)

    def ints(self, values):
        return self.np.asarray(values, dtype=self.np.int64)

    def from_numpy(self, a):
        return a

    def stack(self, arrays):
        return self.np.stack(arrays, axis=-1)

    def i64(self, a):
        return a.astype(self.np.int64)

    def i16(self, a):
        return a.astype(self.np.int16)

    def f32(self, a):
        return a.astype(self.np.float32)

    def f16(self, a):
        return a.astype(self.np.float16)

    def permute(self, a, axes):
        return a.transpose(axes)


class TorchOps:
    """The same on torch tensors of one device."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def arange(self, a, b):
        return self.torch.arange(a, b, dtype=self.torch.int64, device=self.device)

    def ints(self, values):
        return self.torch.tensor(values, dtype=self.torch.int64, device=self.device)

    def from_numpy(self, a):
        return self.torch.from_numpy(a).to(self.device)

    def stack(self, arrays):
        return self.torch.stack(arrays, dim=-1)

    def i64(self, a):
        return a.to(self.torch.int64)

    def i16(self, a):
        return a.to(self.torch.int16)

    def f32(self, a):
        return a.to(self.torch.float32)

    def f16(self, a):
        return a.to(self.torch.float16)

    def permute(self, a, axes):
        return a.permute(*axes)


def _signed(v):
    return v - (1 << 64) if v >= 1 << 63 else v


def _lsr(z, s):
    """Logical right shift of int64 two's-complement values (0 < s < 64)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def rng_values(ops, seed, first, count):
    """Values first+1 .. first+count of Rng(seed).next() as int64 two's complement: value i is
    mix(state + i * GOLDEN), so any stretch is computed at once (int64 products wrap as uint64's)."""
    z = ops.arange(first + 1, first + count + 1) * _signed(GOLDEN) + _signed(rng_state(seed))
    z = (z ^ _lsr(z, 30)) * _signed(MIX1)
    z = (z ^ _lsr(z, 27)) * _signed(MIX2)
    return z ^ _lsr(z, 31)


def random_linear(ops, k, n, K, seed):
    """RandomLinear(k, n, K, cb, seed)'s trellis (int16 [k/16, n/16, 16K]), suh and svh (fp16):
    four trellis words per value (low half first), then per suh / svh element a sign value and a
    uniform value, in that order (g++ evaluates RandomLinear's product left to right; the CPU
    test holds the port to the C++), suh scaled by the float32 1/sqrt(k)."""
    import numpy as np
    words = (k // 16) * (n // 16) * 16 * K
    r = rng_values(ops, seed, 0, words // 4)
    w = ops.stack([r & 0xFFFF] + [_lsr(r, 16 * j) & 0xFFFF for j in (1, 2, 3)])
    trellis = ops.i16(w - ((w >> 15) << 16)).reshape(k // 16, n // 16, 16 * K)
    v = rng_values(ops, seed, words // 4, 2 * (k + n))
    sign = ops.f32(1 - 2 * (v[0::2] & 1))
    mag = 0.5 + ops.f32(_lsr(v[1::2], 40)) * (1.0 / 16777216.0)
    scale = float(np.float32(1.0) / np.sqrt(np.float32(k)))
    suh = ops.f16(sign[:k] * mag[:k] * scale)
    svh = ops.f16(sign[k:] * mag[k:])
    return trellis, suh, svh


# --- The reference: W_inner decoded here, Hadamards in float ---------------------------------------

def codebook_table(codebook):
    """float32 [65536]: the fp16 value of every 16-bit trellis state (EXL3_FORMAT.md's codebooks)."""
    import numpy as np
    s = np.arange(65536, dtype=np.uint64)
    if codebook == "mul1":
        x = (s * 0x83DCD12D) & 0xFFFFFFFF
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        scale = float(np.array([0x1EEE], dtype=np.uint16).view(np.float16)[0])
        bias = float(np.array([0xC931], dtype=np.uint16).view(np.float16)[0])
        value = (1024.0 + byte_sum.astype(np.float64)) * scale + bias  # exact: one fp16 rounding below
    else:
        mult, add = (0xCBAC1FED, 0) if codebook == "mcg" else (89226354, 64248484)
        x = (s * mult + add) & 0xFFFFFFFF
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
        hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
        value = lo + hi
    return value.astype(np.float16).astype(np.float32)


def _tile_order():
    """order[r * 16 + c] = stream element at tile row r, column c (element e = 8t + j)."""
    order = [0] * 256
    for e in range(256):
        t, j = divmod(e, 8)
        r = 2 * (t % 4) + (j & 1) + (8 if j & 2 else 0)
        c = t // 4 + (8 if j & 4 else 0)
        order[r * 16 + c] = e
    return order


def decode_inner(ops, trellis, K, table):
    """W_inner [k, n] (float32) from trellis [k/16, n/16, 16K] int16 (EXL3_FORMAT.md: MSB-first
    stream of little-endian u32 words, state of element e = stream bits (e+1)K-16 .. (e+1)K-1,
    tail-biting); table: codebook_table on the same backend."""
    kt, nt, nwords = trellis.shape
    u16 = ops.i64(trellis).reshape(kt * nt, nwords) & 0xFFFF
    u32 = u16[:, 0::2] | (u16[:, 1::2] << 16)
    n32 = 8 * K
    first, second, shift = [], [], []
    for e in range(256):
        w, o = divmod(((e + 1) * K - 16) % (256 * K), 32)
        first.append(w)
        second.append((w + 1) % n32)
        shift.append(32 - o)
    # 48 stream bits from word w on: the 16 at offset o are bits 32-o .. 47-o.
    window = (u32[:, ops.ints(first)] << 16) | (u32[:, ops.ints(second)] >> 16)
    values = table[(window >> ops.ints(shift)) & 0xFFFF]
    tiles = values[:, ops.ints(_tile_order())].reshape(kt, nt, 16, 16)
    return ops.permute(tiles, (0, 2, 1, 3)).reshape(kt * 16, nt * 16)


def hadamard128():
    """H128 / sqrt(128), Sylvester order, float64 numpy."""
    import numpy as np
    i = np.arange(128)
    both = np.bitwise_and.outer(i, i)
    parity = sum((both >> b) & 1 for b in range(7)) & 1
    return (1.0 - 2.0 * parity) / np.sqrt(128.0)


def linear_ref(x, w_inner, suh, svh, had):
    """x · diag(suh) H W_inner H diag(svh): ((x ⊙ suh) H) W_inner H ⊙ svh, H block-diagonal."""
    m, k = x.shape
    n = w_inner.shape[1]
    xh = ((x * suh).reshape(m, k // 128, 128) @ had).reshape(m, k)
    y = xh @ w_inner
    return (y.reshape(m, n // 128, 128) @ had).reshape(m, n) * svh


# --- The Markdown table of this script's records ----------------------------------------------------

def _us(v):
    return "-" if v is None else f"{v:.1f}"


def _path_cell(rec, name):
    p = rec["paths"].get(name)
    if p is None:
        return "-"
    if p.get("us") is None:
        return "n/a"
    cell = _us(p["us"])
    if p.get("timing") == "eager":
        cell += " (eager)"
    if not p.get("ok", True):
        cell += " (failed check)"
    return cell


def best_label(rec):
    path = rec.get("best_path")
    if path is None:
        return "-"
    kernel = rec["paths"][path].get("kernel")
    return f"{path} ({kernel})" if kernel else path


def format_table(records):
    """Markdown: one table per group of this script's JSON records (device record first)."""
    device = next((r for r in records if r.get("bench") == "exllamav3_device"), None)
    lines = [f"## exllamav3 {device['exllamav3'] if device else EXLLAMAV3_VERSION} kernels, "
             "\u00b5s per call (median of CUDA-graph replays)", ""]
    if device:
        lines += [f"{device['device']} ({device['sms']} SMs), torch {device['torch']}, "
                  f"EXL3_INT8_GEMV={device['int8_gemv']}, {device['reps']} replays per figure.", ""]
    lines += ["exllamav3's own choice: exl3_gemm up to 144 rows (the kernel it took in brackets), "
              "reconstruct+hgemm above, reconstruct_had+hgemm from 1024 rows; MoE: coop up to 8 tokens, "
              "fused above. \"n/a\": the path refused the case (see Errors).", ""]
    sections = (
        ("exllamav3_gemv", "GEMV and decode-sized GEMM (LinearEXL3: exl3_gemm and what it chose; "
         "other paths forced)", ("case",)),
        ("exllamav3_moe", "MoE layer decode (routed top-k + shared expert)", ("layer", "T", "experts")),
        ("exllamav3_gemm", "Prefill GEMM", ("case",)),
    )
    for bench, title, keys in sections:
        rows = [r for r in records if r.get("bench") == bench]
        if not rows:
            continue
        paths = [p for p in PATH_ORDER if any(p in r["paths"] for r in rows)]
        lines += [f"### {title}", "",
                  "| " + " | ".join(keys + ("best", "best path") + tuple(paths) + ("rel. error of best",)) + " |",
                  "|" + "---|" * (len(keys) + 3 + len(paths))]
        for r in rows:
            if bench == "exllamav3_moe":
                touched = r.get("experts_touched")
                head = [r["layer"], str(r["T"]), "-" if touched is None else f"{touched:.1f}"]
            else:
                head = [r["case"]]
            err = r["paths"][r["best_path"]]["rel_err"] if r.get("best_path") else None
            cells = head + [_us(r.get("best_us")), best_label(r)] + [_path_cell(r, p) for p in paths]
            cells.append("-" if err is None else f"{err:.1e}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    errors = [f"{case_label(r)}: {r['error']}" for r in records if r.get("error")]
    errors += [f"{case_label(r)}, {name}: {p['error']}" for r in records
               for name, p in r.get("paths", {}).items() if p.get("error")]
    if errors:
        lines += ["Errors:", ""] + [f"- {e}" for e in errors] + [""]
    skipped = [r["case"] for r in records if r.get("bench") == "exllamav3_skipped"]
    if skipped:
        lines += [f"Not run (time budget): {', '.join(skipped)}.", ""]
    return "\n".join(lines)


def case_label(rec):
    return rec["case"] if "case" in rec else f"{rec['layer']} T={rec['T']}"


def finish_record(rec, default_path):
    """Adds best / default figures to a case record from its paths."""
    ok = {n: p for n, p in rec["paths"].items() if p.get("us") is not None and p.get("ok")}
    rec["default_path"] = default_path
    rec["default_us"] = rec["paths"].get(default_path, {}).get("us")
    rec["best_path"] = min(ok, key=lambda n: ok[n]["us"]) if ok else None
    rec["best_us"] = ok[rec["best_path"]]["us"] if ok else None
    return rec


# --- On the GPU ------------------------------------------------------------------------------------

def log(msg):
    print(f"exllamav3_kernels: [{time.monotonic() - START:5.1f} s] {msg}", flush=True)


@contextlib.contextmanager
def env_var(name, value):
    """Sets (value None: removes) an environment variable for the block: exllamav3 reads
    EXL3_GEMV at every call, so a path is chosen while its warm-up and capture run."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def load_extension():
    """exllamav3_ext, the prebuilt extension scripts/gpu/exllamav3_install.sh puts beside the
    package (its import needs torch first), and the package's version read from its files."""
    import importlib.util
    import torch  # noqa: F401  (the extension links against the loaded torch)
    try:
        import exllamav3_ext
    except ImportError as e:
        sys.exit(f"exllamav3_kernels: exllamav3_ext does not import ({e}): run "
                 "scripts/gpu/exllamav3_install.sh (carry .exl3v3-a) and put its folder on PYTHONPATH")
    version = "unknown"
    spec = importlib.util.find_spec("exllamav3")
    if spec and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        if os.path.exists(path):
            with open(path) as f:
                found = re.search(r"__version__\s*=\s*[\"']([^\"']+)", f.read())
            version = found.group(1) if found else version
    if version != EXLLAMAV3_VERSION:
        log(f"warning: exllamav3 {version} found, {EXLLAMAV3_VERSION} expected")
    return exllamav3_ext, version


class Timer:
    def __init__(self, torch, reps):
        self.torch, self.reps = torch, reps
        self.stream = torch.cuda.Stream()

    def median_us(self, fn, calls):
        """Median per-call time (µs) of fn(0) .. fn(calls - 1), captured into one graph and
        replayed; eager launches where capture fails."""
        torch = self.torch
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        timing = "graph"
        try:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    for i in range(calls):
                        fn(i)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(self.stream)
            run = graph.replay
        except RuntimeError as e:
            log(f"  capture failed ({str(e).splitlines()[0]}): timing eager launches")
            torch.cuda.synchronize()
            graph, timing = None, "eager"

            def run():
                for i in range(calls):
                    fn(i)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(self.reps):
            a.record()
            run()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3 / calls)
        return statistics.median(samples), timing


def first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def rel_err(out, ref):
    d = (out.double() - ref.double()).norm().item()
    return d / max(ref.double().norm().item(), 1e-300)


class Runner:
    def __init__(self, args):
        import numpy as np
        import torch
        if args.int8_gemv is not None:
            os.environ["EXL3_INT8_GEMV"] = args.int8_gemv  # read once, at the first MUL1 exl3_gemm
        self.ext, self.version = load_extension()
        self.torch, self.np = torch, np
        torch.backends.cuda.matmul.allow_tf32 = False
        self.dev = torch.device("cuda", 0)
        torch.cuda.set_device(self.dev)
        self.ops = TorchOps(torch, self.dev)
        self.timer = Timer(torch, args.reps)
        self.args = args
        self.had = torch.from_numpy(hadamard128()).float().to(self.dev)
        self.tables = {}
        self.gen = torch.Generator(device=self.dev).manual_seed(args.seed)
        self.json = open(args.json, "w") if args.json else None
        self.records = []
        props = torch.cuda.get_device_properties(self.dev)
        self.emit({"bench": "exllamav3_device", "exllamav3": self.version, "torch": torch.__version__,
                   "device": props.name, "sms": props.multi_processor_count, "reps": args.reps,
                   "int8_gemv": os.environ.get("EXL3_INT8_GEMV", "unset (exllamav3's default, 2)")})
        self.check_backends()

    def emit(self, rec):
        self.records.append(rec)
        if self.json:
            self.json.write(json.dumps(rec) + "\n")
            self.json.flush()

    def over_budget(self):
        return time.monotonic() - START > self.args.budget_s

    def skip(self, case):
        self.emit({"bench": "exllamav3_skipped", "case": case.name, "group": case.group})

    def table(self, codebook):
        if codebook not in self.tables:
            self.tables[codebook] = self.ops.from_numpy(codebook_table(codebook))
        return self.tables[codebook]

    def check_backends(self):
        """The torch generator and decoder against the numpy ones (which the CPU test holds to
        exl3-bench's RandomLinear and to the golden vectors) on one small layer."""
        cpu = NumpyOps()
        t_np = random_linear(cpu, 256, 384, 3, 4242)
        t_gpu = random_linear(self.ops, 256, 384, 3, 4242)
        for a, b, what in zip(t_np, t_gpu, ("trellis", "suh", "svh")):
            if not self.np.array_equal(a.view(self.np.int16), b.cpu().numpy().view(self.np.int16)):
                sys.exit(f"exllamav3_kernels: the torch generator's {what} differs from the numpy port's")
        w_np = decode_inner(cpu, t_np[0], 3, codebook_table("mcg"))
        w_gpu = decode_inner(self.ops, t_gpu[0], 3, self.table("mcg")).cpu().numpy()
        if not self.np.array_equal(w_np, w_gpu):
            sys.exit("exllamav3_kernels: the torch decoder differs from the numpy one")
        log("torch generator and decoder match the numpy port")

    def randn(self, *shape):
        return self.torch.randn(shape, generator=self.gen, device=self.dev).half()

    def finish(self, rec, default_path):
        rec = finish_record(rec, default_path)
        self.emit(rec)
        best = f"{rec['best_us']:.1f} us ({best_label(rec)})" if rec["best_path"] else "no path passed"
        log(f"  {case_label(rec)}: best {best}")

    def path(self, rec, name, fn, calls, check, reset, env=None, kernel=None):
        """Warms up, checks and times one path: fn(i) runs call i; reset() poisons call 0's output
        (NaN) and check() returns its relative error; kernel(fn(0)'s result) names what it
        launched. An exception is recorded as the path's error."""
        try:
            with env_var("EXL3_GEMV", env):
                result = fn(0)  # first use: exllamav3's autotuners and one-time set-up
                entry = {"kernel": kernel(result)} if kernel else {}
                reset()
                fn(0)
                err = check()
                us, timing = self.timer.median_us(fn, calls)
        except Exception as e:  # a call exllamav3 refuses (or a wrong one) must not end the run
            rec["paths"][name] = {"us": None, "error": first_line(e)}
            log(f"  {name}: {rec['paths'][name]['error']}")
            self.torch.cuda.synchronize()
            return None
        tolerance = TOLERANCE_INT8 if entry.get("kernel") == "int8 GEMV" else TOLERANCE
        finite = err == err and err != float("inf")
        entry.update({"us": us, "timing": timing, "rel_err": err if finite else None,
                      "ok": finite and err <= tolerance})
        rec["paths"][name] = entry
        return entry

    # --- dense linears ---

    def run_linear(self, cases):
        torch = self.torch
        keys = []
        for c in cases:
            if c.weight_key not in keys:
                keys.append(c.weight_key)
        for key in keys:
            group = [c for c in cases if c.weight_key == key]
            if self.over_budget():
                for c in group:
                    self.skip(c)
                continue
            k, n, K, cb, seed = key
            trellis, suh, svh = random_linear(self.ops, k, n, K, seed)
            w_inner = decode_inner(self.ops, trellis, K, self.table(cb))
            wbytes = trellis.numel() * 2
            copies = 1 if group[0].group == "gemm" else min(max((256 << 20) // wbytes + 1, 2), 64)
            weights = [(trellis, suh, svh)] + [(trellis.clone(), suh.clone(), svh.clone())
                                               for _ in range(copies - 1)]
            log(f"{k}x{n} K={K} {cb}: {copies} weight copies")
            for case in group:
                if self.over_budget():
                    self.skip(case)
                    continue
                self.run_linear_case(case, weights, w_inner)
            del weights, w_inner
            torch.cuda.empty_cache()

    def run_linear_case(self, case, weights, w_inner):
        torch, ext = self.torch, self.ext
        m, k, n, K, cb = case.m, case.k, case.n, case.K, case.codebook
        mcg, mul1 = cb == "mcg", cb == "mul1"
        copies = len(weights)
        rec = {"bench": f"exllamav3_{case.group}", "case": case.name, "m": m, "k": k, "n": n, "K": K,
               "codebook": cb, "seed": case.seed, "copies": copies, "paths": {}}
        try:
            xs = [self.randn(m, k) for _ in range(copies)]
            ys = [torch.empty((m, n), dtype=torch.half, device=self.dev) for _ in range(copies)]
            xhs = [torch.empty_like(x) for x in xs]
            ref = linear_ref(xs[0].float(), w_inner, weights[0][1].float(), weights[0][2].float(), self.had)
            reset = lambda: ys[0].fill_(float("nan"))

            def check():
                torch.cuda.synchronize()
                return rel_err(ys[0], ref)

            def exl3_gemm(i):  # BC_LinearEXL3::run at m > 1 (its own xh scratch per call)
                t, s, v = weights[i]
                return ext.exl3_gemm(xs[i], t, ys[i], s, xhs[i], v, -1, mcg, mul1, 0)

            def exl3_gemv(i):
                t, s, v = weights[i]
                ext.exl3_gemv(xs[i], t, ys[i], s, xhs[i], v, mcg, mul1)

            if m <= AUTO_RECONSTRUCT_THRESHOLD:
                name = lambda tag: gemm_kernel_name(tag, cb)
                chosen = self.path(rec, P_GEMM, exl3_gemm, copies, check, reset, kernel=name)
                if gemv_eligible(m, k, n, K, cb):
                    self.path(rec, P_GEMV, exl3_gemv, copies, check, reset)
                if chosen and chosen["kernel"] == "GEMV":
                    self.path(rec, P_GEMM_NO_GEMV, exl3_gemm, copies, check, reset, env="0", kernel=name)
            if case.group == "gemm":
                self.reconstruct_paths(rec, case, weights[0], xs[0], ys[0], check, reset)
        except Exception as e:  # one case's failure must not end the run
            rec["error"] = first_line(e)
            log(f"  {case.name}: {rec['error']}")
        self.finish(rec, linear_default_path(m))

    def reconstruct_paths(self, rec, case, weight, x, y, check, reset):
        """LinearEXL3.reconstruct_hgemm's two forms (one slice: n <= 32768 here)."""
        torch, ext = self.torch, self.ext
        trellis, suh, svh = weight
        mcg, mul1 = case.codebook == "mcg", case.codebook == "mul1"
        w = torch.empty((case.k, case.n), dtype=torch.half, device=self.dev)
        xh = torch.empty_like(x)

        def unfused(_):
            ext.had_r_128(x, xh, suh, None, 1.0)
            ext.reconstruct(w, trellis, case.K, mcg, mul1)
            ext.hgemm_recon(xh, w, y)
            ext.had_r_128(y, y, None, svh, 1.0)

        def fused(_):
            ext.reconstruct_had_slice(w, trellis, suh, svh, case.K, mcg, mul1, 0)
            ext.hgemm_recon(x, w, y)

        self.path(rec, P_RECON, unfused, 1, check, reset)
        self.path(rec, P_RECON_HAD, fused, 1, check, reset)

    # --- MoE layers ---

    def run_moe(self, cases):
        layers = []
        for c in cases:
            if (c.shape, c.K, c.codebook) not in layers:
                layers.append((c.shape, c.K, c.codebook))
        for shape, K, cb in layers:
            group = [c for c in cases if (c.shape, c.K, c.codebook) == (shape, K, cb)]
            if self.over_budget():
                for c in group:
                    self.skip(c)
                continue
            try:
                layer = MoeLayer(self, shape, K, cb)
            except Exception as e:
                log(f"{group[0].layer}: {first_line(e)}")
                for c in group:
                    self.emit(finish_record({"bench": "exllamav3_moe", "layer": c.layer, "model": shape.model,
                                             "K": K, "codebook": cb, "T": c.T, "experts_touched": None,
                                             "paths": {}, "error": first_line(e)}, None))
                continue
            log(f"{group[0].layer}: layer generated ({layer.bytes / 2**30:.2f} GiB of trellis)")
            for case in group:
                if self.over_budget():
                    self.skip(case)
                    continue
                layer.run_case(case)
            del layer
            self.torch.cuda.empty_cache()


class MoeLayer:
    """One exl3-bench MoE layer in exllamav3's form: per-expert tensors, the pointer tables its
    MultiLinear / BC_BlockSparseMLP build, and the scratch buffers BlockSparseMLP.load_local sizes."""

    def __init__(self, runner, shape, K, cb):
        self.r, self.shape, self.K, self.cb = runner, shape, K, cb
        torch, dev, ops = runner.torch, runner.dev, runner.ops
        H, I, E = shape.hidden, shape.inter, shape.experts
        seed = 11 + K
        self.experts = []
        for e in range(E):  # RandomExpert(hidden, inter, seed * 1000 + e): gate, up, down
            s = (seed * 1000 + e) * 3
            self.experts.append((random_linear(ops, H, I, K, s + 1), random_linear(ops, H, I, K, s + 2),
                                 random_linear(ops, I, H, K, s + 3)))
        self.bytes = sum(t.numel() * 2 for ex in self.experts for t, _, _ in ex)
        self.mcg, self.mul1 = cb == "mcg", cb == "mul1"
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.long, device=dev)
        self.tabs = [ptrs([ex[p][i] for ex in self.experts]) for p in range(3) for i in range(3)]
        self.shared = None
        if shape.shared_inter:
            s = (seed * 1000 + 999) * 3
            Is = shape.shared_inter
            self.shared = (random_linear(ops, H, Is, K, s + 1), random_linear(ops, H, Is, K, s + 2),
                           random_linear(ops, Is, H, K, s + 3))
            self.sh_tabs = [ptrs([self.shared[p][i]]) for p in range(3) for i in range(3)]
            self.sh_gu = [ptrs([self.shared[0][i], self.shared[1][i]]) for i in range(3)]  # MultiLinear [gate, up]
            self.sh_inner = [decode_inner(ops, self.shared[p][0], K, runner.table(cb)) for p in range(3)]
        # exl3_moe_coop scratch as BC_BlockSparseMLP holds it: MAX_BSZN * top-k slots
        slots = MAX_BSZN * shape.topk
        half = dict(dtype=torch.half, device=dev)
        self.coop = [torch.empty((slots, H), **half), torch.empty((slots, H), **half),
                     torch.empty((slots, I), **half), torch.empty((slots, I), **half),
                     torch.empty((slots, I), **half), torch.empty((slots, H), dtype=torch.float, device=dev)]
        self.coop_ctr = torch.zeros((coop_ctr_len(slots, MAX_BSZN, I, H),), dtype=torch.int, device=dev)
        self.coop_out = torch.empty((MAX_BSZN, H), dtype=torch.float, device=dev)
        if self.shared:
            Is = shape.shared_inter
            self.sh_coop = [torch.empty((MAX_BSZN, H), **half), torch.empty((MAX_BSZN, H), **half),
                            torch.empty((MAX_BSZN, Is), **half), torch.empty((MAX_BSZN, Is), **half),
                            torch.empty((MAX_BSZN, Is), **half),
                            torch.empty((MAX_BSZN, H), dtype=torch.float, device=dev)]
            self.sh_ctr = torch.zeros((coop_ctr_len(MAX_BSZN, MAX_BSZN, Is, H),), dtype=torch.int, device=dev)
            self.sh_out = torch.empty((MAX_BSZN, H), dtype=torch.float, device=dev)
            self.sh_sel = torch.zeros((MAX_BSZN, 1), dtype=torch.long, device=dev)
            self.sh_rw = torch.ones((MAX_BSZN, 1), **half)
        # exl3_moe's group buffers (FusedBuffers)
        self.fused_rows = FUSED_ROWS_WIDE if self.mul1 else FUSED_ROWS
        conc = runner.ext.exl3_moe_max_concurrency(dev.index)
        R = self.fused_rows
        self.fused = [torch.empty((conc, R, H), **half), torch.empty((conc, R, H), **half),
                      torch.empty((conc, R, I), **half), torch.empty((conc, R, I), **half)]

    def coop_call(self, x, sel, rw, tabs, scratch, ctr, out, sh_out):
        K = self.K
        self.r.ext.exl3_moe_coop(x, sel, rw, -1, -1, self.shape.hidden, *tabs, None, None, None, K, K, K,
                                 self.mcg, self.mul1, 0, SWIGLU_LIMIT, True, *scratch, ctr, out, sh_out, None)

    def shared_chain(self, x, out, bufs):
        """GatedMLP's shared expert: fused gate+up exl3_mgemm up to 32 rows (BC_GatedMLP at <= 8),
        separate exl3_gemm above; silu_mul; down exl3_gemm into fp32 `out`."""
        ext, K, T = self.r.ext, self.K, x.shape[0]
        (gt, gs, gv), (ut, us, uv), (dt, ds, dv) = self.shared
        if T <= SHARED_MGEMM_MAX_ROWS:
            gu, guh = bufs["gu"], bufs["guh"]
            ext.exl3_mgemm(x.view(1, T, -1), self.sh_gu[0], gu, self.sh_gu[1], guh, self.sh_gu[2], None, None,
                           K, -1, self.mcg, self.mul1, -1, -1, 0)
            g, u = gu[0], gu[1]
        else:
            g, u = bufs["g"], bufs["u"]
            ext.exl3_gemm(x, gt, g, gs, bufs["xh"][0], gv, -1, self.mcg, self.mul1, 0)
            ext.exl3_gemm(x, ut, u, us, bufs["xh"][1], uv, -1, self.mcg, self.mul1, 0)
        ext.silu_mul(g, u, bufs["a"], SWIGLU_LIMIT)
        ext.exl3_gemm(bufs["a"], dt, out, ds, bufs["dxh"], dv, -1, self.mcg, self.mul1, 0)

    def shared_bufs(self, T):
        torch, dev = self.r.torch, self.r.dev
        H, Is = self.shape.hidden, self.shape.shared_inter
        half = dict(dtype=torch.half, device=dev)
        # exactly shaped (2, T, .) slot pairs: exl3_mgemm addresses slot j at j * T * width
        return {"gu": torch.empty((2, T, Is), **half), "guh": torch.empty((2, T, H), **half),
                "g": torch.empty((T, Is), **half), "u": torch.empty((T, Is), **half),
                "xh": torch.empty((2, T, H), **half), "a": torch.empty((T, Is), **half),
                "dxh": torch.empty((T, Is), **half)}

    def reference(self, x, ids, w):
        """Routed sum + shared expert for the rows of x (fp32), exllamav3's SwiGLU clamp: silu(g)
        capped at the limit, u clamped to +-limit."""
        torch, ops, had = self.r.torch, self.r.ops, self.r.had
        xf = x.float()
        out = torch.zeros((x.shape[0], self.shape.hidden), dtype=torch.float, device=self.r.dev)

        def mlp(rows, inner, params):
            (gt, gs, gv), (ut, us, uv), (dt, ds, dv) = params
            g = linear_ref(rows, inner[0], gs.float(), gv.float(), had)
            u = linear_ref(rows, inner[1], us.float(), uv.float(), had)
            a = torch.clamp(torch.nn.functional.silu(g), max=SWIGLU_LIMIT) * torch.clamp(u, -SWIGLU_LIMIT, SWIGLU_LIMIT)
            return linear_ref(a, inner[2], ds.float(), dv.float(), had)

        table = self.r.table(self.cb)
        for e in sorted({e for row in ids for e in row}):
            picks = [(t, row.index(e)) for t, row in enumerate(ids) if e in row]
            params = self.experts[e]
            inner = [decode_inner(ops, params[p][0], self.K, table) for p in range(3)]
            rows = [t for t, _ in picks]
            y = mlp(xf[rows], inner, params)
            for j, (t, slot) in enumerate(picks):
                out[t] += w[t][slot] * y[j]
        if self.shared:
            out += mlp(xf, self.sh_inner, self.shared)
        return out

    def run_case(self, case):
        r, torch = self.r, self.r.torch
        shape, T, K = self.shape, case.T, self.K
        ids, weights, touched = moe_routing(T, shape.topk, shape.experts, K)
        rec = {"bench": "exllamav3_moe", "layer": case.layer, "model": shape.model, "K": K,
               "codebook": self.cb, "T": T, "experts_touched": touched, "in_exl3_bench": shape.in_exl3_bench,
               "paths": {}}
        default = P_COOP if T <= MAX_BSZN else P_FUSED
        try:
            xs = [r.randn(T, shape.hidden) for _ in range(MOE_ROUTING_SETS)]
            sels = [torch.tensor(i, dtype=torch.long, device=r.dev) for i in ids]
            rws = [torch.tensor(w, dtype=torch.float, device=r.dev).half() for w in weights]
            nt = min(T, 4)  # tokens checked
            ref = self.reference(xs[0][:nt], ids[0][:nt], rws[0][:nt].float().tolist())
            if T <= MAX_BSZN:
                self.coop_paths(rec, xs, sels, rws, nt, ref)
            else:
                self.fused_path(rec, xs, ids, sels, rws, nt, ref)
        except Exception as e:  # one case's failure must not end the run
            rec["error"] = first_line(e)
            log(f"  {case.name}: {rec['error']}")
        r.finish(rec, default)

    def coop_paths(self, rec, xs, sels, rws, nt, ref):
        """BC_BlockSparseMLP::run_bszN, T <= MAX_BSZN."""
        r, torch = self.r, self.r.torch
        T = xs[0].shape[0]
        out = self.coop_out
        reset = lambda: out.fill_(float("nan"))

        def check():
            torch.cuda.synchronize()
            return rel_err(out[:nt], ref)

        def coop(q):
            if self.shared:  # sh_coop: the shared expert as one expert of weight 1, into sh_out
                self.coop_call(xs[q], self.sh_sel[:T], self.sh_rw[:T], self.sh_tabs, self.sh_coop, self.sh_ctr,
                               self.sh_out, None)
            self.coop_call(xs[q], sels[q], rws[q], self.tabs, self.coop, self.coop_ctr, out,
                           self.sh_out if self.shared else None)

        r.path(rec, P_COOP, coop, MOE_ROUTING_SETS, check, reset)
        if self.shared:
            bufs = self.shared_bufs(T)

            def coop_chain(q):
                self.shared_chain(xs[q], self.sh_out[:T], bufs)
                self.coop_call(xs[q], sels[q], rws[q], self.tabs, self.coop, self.coop_ctr, out, self.sh_out)

            r.path(rec, P_COOP_CHAIN, coop_chain, MOE_ROUTING_SETS, check, reset)

    def fused_path(self, rec, xs, ids, sels, rws, nt, ref):
        """BlockSparseMLP.forward's fused tier, T > MAX_BSZN (see the module docstring)."""
        r, torch, ext = self.r, self.r.torch, self.r.ext
        shape, K, dev = self.shape, self.K, self.r.dev
        T, E, topk, H = len(ids[0]), shape.experts, shape.topk, shape.hidden
        A, R = T * topk, self.fused_rows
        all_fused = A <= R  # else the module reads the counts back and builds the tables on the host
        host = []
        if not all_fused:
            for set_ids in ids:
                flat = [e for row in set_ids for e in row]
                if self.mul1 and max(flat.count(e) for e in set(flat)) > MTILE_T1:
                    raise ValueError(f"an expert gets more than {MTILE_T1} rows: the MUL1 row-tile "
                                     "launches are not mirrored here")
                base, start, kind, active = fused_host_tables(flat, E, R)
                host.append((torch.tensor([base, start, kind], dtype=torch.long, device=dev), active))
        flat_token = torch.arange(T, device=dev).repeat_interleave(topk)
        positions = torch.arange(A, device=dev)
        ones = torch.ones(A, dtype=torch.long, device=dev)
        finals = [torch.empty((T, H), dtype=torch.float, device=dev) for _ in ids]
        scratch = torch.empty((A, H), dtype=torch.float, device=dev)
        bufs = self.shared_bufs(T) if self.shared else None
        sh_y = torch.empty((T, H), dtype=torch.float, device=dev)

        def fused(q):
            final = finals[q]
            final.zero_()
            flat_expert = sels[q].view(-1)
            order = flat_expert.argsort()
            token_sorted = flat_token[order]
            weight_sorted = rws[q].view(-1)[order]
            count = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, flat_expert, ones)
            inv_order = torch.empty_like(order).scatter_(0, order, positions)
            if all_fused:
                start = torch.cumsum(count, 0) - count
                tables, active = torch.stack([start, start, (count > 0).long()]), -1
            else:
                tables, active = host[q]
            ext.exl3_moe(xs[q], final, count, token_sorted, weight_sorted, *self.fused, 0, K, K, K, *self.tabs,
                         self.mcg, self.mul1, self.mcg, self.mul1, self.mcg, self.mul1, SWIGLU_LIMIT, active,
                         scratch, tables[0], 1, R, 16)
            ext.exl3_moe_gather(final, scratch, flat_expert, inv_order, tables[1, :E], tables[0, :E],
                                tables[2, :E], weight_sorted)
            if self.shared:
                self.shared_chain(xs[q], sh_y, bufs)
                final += sh_y

        def check():
            torch.cuda.synchronize()
            return rel_err(finals[0][:nt], ref)

        r.path(rec, P_FUSED, fused, len(ids), check, lambda: finals[0].fill_(float("nan")))


def coop_ctr_len(slots_max, rows_max, inter, out_width):
    """exl3_moe_coop_ctr_len (quant/exl3_moe_coop.cuh): completion counters and the run table."""
    return slots_max * (inter // 128) + rows_max * (out_width // 128) + 2 + (slots_max + 1) + slots_max


# --- Command line ----------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated: gemv, moe, gemm")
    ap.add_argument("--only", help="regular expression a case's name must match (e.g. 'm=1 ', 'GLM-5.3')")
    ap.add_argument("--list", action="store_true", help="print the selected cases and exit")
    ap.add_argument("--json", help="JSON lines out")
    ap.add_argument("--md", help="Markdown table out")
    ap.add_argument("--reps", type=int, default=30, help="timed graph replays per figure")
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="start no new case after this many seconds from the script's start")
    ap.add_argument("--int8-gemv", choices=("0", "1", "2"),
                    help="EXL3_INT8_GEMV for the run (default: the environment's, else exllamav3's 2)")
    ap.add_argument("--seed", type=int, default=20261207, help="seed of the inputs x")
    args = ap.parse_args(argv)
    try:
        args.cases = select_cases(args.groups, args.only)
    except (ValueError, re.error) as e:
        ap.error(str(e))
    if not args.cases:
        ap.error("no case selected")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        for c in args.cases:
            print(f"{c.group}\t{c.name}")
        return 0
    try:
        import torch
    except ImportError as e:
        sys.exit(f"exllamav3_kernels: torch does not import ({e}): this runs on the GPU machine")
    if not torch.cuda.is_available():
        sys.exit("exllamav3_kernels: no CUDA device")
    log(f"{len(args.cases)} cases: " + ", ".join(f"{sum(c.group == g for c in args.cases)} {g}" for g in GROUPS))
    runner = Runner(args)
    with torch.inference_mode():
        runner.run_linear([c for c in args.cases if c.group == "gemv"])
        runner.run_moe([c for c in args.cases if c.group == "moe"])
        runner.run_linear([c for c in args.cases if c.group == "gemm"])
    md = format_table(runner.records)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    print(md)
    failed = [case_label(r) for r in runner.records
              if "paths" in r and any(p.get("ok") is False for p in r["paths"].values())]
    if failed:
        log(f"paths over their tolerance in: {', '.join(failed)}")
    log("done")
    return 4 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
