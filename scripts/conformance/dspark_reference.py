"""DeepSeek-V4's DSPARK block drafter (the checkpoint's mtp.* component) in fp32 torch: what
docs/dspark.md states, as exllamav3 1.6.5 computes it (architecture/deepseek_v4_mtp.py,
modules/arch_specific/dspark.py, generator/generator.py), written here from that description.

    cfg = DsparkConfig.from_json(config_dict)                       # config.json, release layout
    drafter = DsparkDrafter(cfg, tensors, embed, head)              # mtp.* (fp32), trunk embed / head
    taps = trunk_taps(model, ids, cfg.target_layer_ids)             # transformers' DeepseekV4 model
    rows = drafter.main_kv(taps)                                    # every block's main-kv rows
    d = drafter.draft(rows, seed=int(ids[p0]), p0=p0)               # one draft call at position p0

`trunk_taps` (`trunk_pass`) runs transformers' DeepseekV4 model and takes, at each tapped layer L, the mean over
the hyper-connection streams of that layer's output (exllamav3 exports `x.mean(dim = 2)` after the
block). `DsparkDrafter.main_kv` derives each block's main-kv row of every position from them;
`draft` runs one block forward at p0 (seed = the token at p0, history = rows 0..p0-1, the last
`sliding_window` of them read) and the Markov loop, and returns the head's logits, the biased
logits the loop took its argmax over, the drafts, the confidence logits and the draft length.
`check_against_transformers` compares this file's block (hyper-connections, attention with a causal
window mask, MoE) with transformers' DeepseekV4DecoderLayer on the same weights.

Tensor names are the release ones (docs/dspark.md): mtp.{i}.attn.wq_a.weight, ...; wo_a whole
([o_groups * o_lora_rank, in]; exl3-tool's per-group slices concatenated back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_RATIO_SLIDING = 0


@dataclass
class DsparkConfig:
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rope_theta: float
    hc_mult: int
    sinkhorn_iters: int
    hc_eps: float
    eps: float
    experts: int
    top_k: int
    moe_intermediate: int
    shared_experts: int
    routed_scaling_factor: float
    swiglu_limit: float
    vocab: int
    block_size: int
    noise_token_id: int
    markov_rank: int
    target_layer_ids: list
    num_blocks: int
    conf_threshold: float = 0.5

    @staticmethod
    def from_json(c: dict) -> "DsparkConfig":
        """From config.json (DeepSeek-V4's release fields, or transformers' where both exist)."""
        n_layers = c["num_hidden_layers"]
        ratios = c.get("compress_ratios")
        if not ratios or len(ratios) <= n_layers:
            raise ValueError("config.json: no MTP blocks (compress_ratios has no entry past num_hidden_layers)")
        tail = ratios[n_layers:]
        if any(r != _RATIO_SLIDING for r in tail):
            raise ValueError(f"config.json: MTP blocks must be sliding (compress ratio 0), got {tail}")
        head_dim = c.get("head_dim", 512)
        rp = c.get("rope_parameters") or {}
        main = rp.get("main", {}) if isinstance(rp.get("main"), dict) else {}
        rope_dim = c.get("qk_rope_head_dim") or int(head_dim * main.get("partial_rotary_factor",
                                                                        c.get("partial_rotary_factor", 1.0)))
        taps = sorted(c.get("dspark_target_layer_ids") or [])
        return DsparkConfig(
            hidden=c["hidden_size"], heads=c["num_attention_heads"], head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=c["q_lora_rank"], o_groups=c.get("o_groups", 8), o_lora_rank=c.get("o_lora_rank", 1024),
            window=c.get("sliding_window", 128),
            rope_theta=float(c.get("rope_theta", main.get("rope_theta", 10000.0))),
            hc_mult=c.get("hc_mult", 4), sinkhorn_iters=c.get("hc_sinkhorn_iters", 20), hc_eps=c.get("hc_eps", 1e-6),
            eps=c.get("rms_norm_eps", 1e-6), experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"],
            moe_intermediate=c["moe_intermediate_size"], shared_experts=c.get("n_shared_experts", 1),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(c.get("swiglu_limit", 10.0)), vocab=c["vocab_size"],
            block_size=c["dspark_block_size"], noise_token_id=c.get("dspark_noise_token_id", 0),
            markov_rank=c.get("dspark_markov_rank", 256), target_layer_ids=taps, num_blocks=len(tail))


# ---------------------------------------------------------------------------------------------
# Pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def inv_freq(cfg: DsparkConfig) -> torch.Tensor:
    """The 'main' rope (the sliding layers'): theta^(-2j/rd), no YaRN."""
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim))


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Rotates the last len(freqs) * 2 dims of x [n, D] or [n, heads, D] GPT-J style (pairs (2j, 2j+1))
    by sign * positions[i] * freq_j."""
    rd = 2 * freqs.numel()
    angle = (positions.double()[:, None] * freqs[None, :]) * sign          # [n, rd/2]
    if x.dim() == 3:
        angle = angle[:, None, :]                                          # over the heads
    cos, sin = angle.cos().float(), angle.sin().float()
    nope, r = x[..., :-rd], x[..., -rd:]
    even, odd = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rot), dim=-1)


class Router(torch.nn.Module):
    """sqrt(softplus) router ("sqrtsp"): `weight` [E, H], `e_score_correction_bias` [E] (the stored
    gate.bias; selection only). The names are those engine_fixtures.py's routing-margin code reads."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.float().clone(), requires_grad=False)
        self.register_buffer("e_score_correction_bias", bias.float().clone())
        self.top_k, self.scale = top_k, scale

    def forward(self, h: torch.Tensor):
        scores = torch.sqrt(F.softplus(h @ self.weight.t()))
        idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        w = scores.gather(-1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


def swiglu_mlp(h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float):
    gate = (h @ w1.t()).clamp(max=limit)
    up = (h @ w3.t()).clamp(min=-limit, max=limit)
    return (F.silu(gate) * up) @ w2.t()


class Moe(torch.nn.Module):
    """Routed experts (top-k by Router) plus the shared expert, swiglu_limit on both."""

    def __init__(self, cfg: DsparkConfig, t: dict, p: str):
        super().__init__()
        self.gate = Router(t[p + "gate.weight"], t[p + "gate.bias"], cfg.top_k, cfg.routed_scaling_factor)
        self.w1 = torch.stack([t[f"{p}experts.{e}.w1.weight"] for e in range(cfg.experts)]).float()
        self.w2 = torch.stack([t[f"{p}experts.{e}.w2.weight"] for e in range(cfg.experts)]).float()
        self.w3 = torch.stack([t[f"{p}experts.{e}.w3.weight"] for e in range(cfg.experts)]).float()
        self.s1, self.s2, self.s3 = (t[f"{p}shared_experts.{w}.weight"].float() for w in ("w1", "w2", "w3"))
        self.limit = cfg.swiglu_limit

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        idx, w = self.gate(x)
        out = swiglu_mlp(x, self.s1, self.s2, self.s3, self.limit)
        for r in range(x.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[r, k])
                out[r] += w[r, k] * swiglu_mlp(x[r], self.w1[e], self.w2[e], self.w3[e], self.limit)
        return out.reshape(shape)


def hc_mix(streams: torch.Tensor, fn, base, scale, cfg: DsparkConfig):
    """A manifold-constrained hyper-connection site over streams [n, hc, H]: (post [n, hc],
    comb [n, hc, hc], collapsed [n, H])."""
    n, m, _ = streams.shape
    flat = rms_norm(streams.reshape(n, -1), None, cfg.eps)
    mixes = flat @ fn.t()
    pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
    pre_b, post_b, comb_b = base.split([m, m, m * m])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + cfg.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(n, m, m) * scale[2] + comb_b.view(m, m), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(1)
    return post, comb, collapsed


def hc_apply(streams, out, post, comb):
    """New streams: post[k] * out + sum_j comb[j, k] * streams[j]."""
    return post.unsqueeze(-1) * out.unsqueeze(1) + torch.einsum("njk,njd->nkd", comb, streams)


def hc_head(streams, fn, base, scale, cfg: DsparkConfig):
    """The final collapse: sigmoid(mixes * scale + base) + eps weights over the streams."""
    n = streams.shape[0]
    flat = rms_norm(streams.reshape(n, -1), None, cfg.eps)
    pre = torch.sigmoid((flat @ fn.t()) * scale + base) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(1)


# ---------------------------------------------------------------------------------------------
# One DSPARK block


class DsparkBlock(torch.nn.Module):
    """mtp.{i}.*: a DeepSeek-V4 sliding decoder block whose attention reads main-kv history."""

    def __init__(self, cfg: DsparkConfig, t: dict, i: int):
        super().__init__()
        p = f"mtp.{i}."
        self.cfg = cfg
        g = lambda name: t[p + name].float()  # noqa: E731
        self.attn_norm, self.ffn_norm = g("attn_norm.weight"), g("ffn_norm.weight")
        self.hc_attn = (g("hc_attn_fn"), g("hc_attn_base"), g("hc_attn_scale"))
        self.hc_ffn = (g("hc_ffn_fn"), g("hc_ffn_base"), g("hc_ffn_scale"))
        self.wq_a, self.q_norm, self.wq_b = g("attn.wq_a.weight"), g("attn.q_norm.weight"), g("attn.wq_b.weight")
        self.wkv, self.kv_norm = g("attn.wkv.weight"), g("attn.kv_norm.weight")
        self.wo_a, self.wo_b = g("attn.wo_a.weight"), g("attn.wo_b.weight")
        self.sinks = g("attn.attn_sink")
        self.mlp = Moe(cfg, t, p + "ffn.")
        self.freqs = inv_freq(cfg)

    def kv(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """K = V rows [n, D] of hidden states h [n, H] at their positions."""
        return rope(rms_norm(h @ self.wkv.t(), self.kv_norm, self.cfg.eps), positions, self.freqs)

    def queries(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        q = (rms_norm(h @ self.wq_a.t(), self.q_norm, c.eps) @ self.wq_b.t()).view(-1, c.heads, c.head_dim)
        return rope(rms_norm(q, None, c.eps), positions, self.freqs)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor):
        """q [n, heads, D] over keys = values [m, D] where visible [n, m]; one softmax with the
        per-head sink; the output's rope slice rotated back at each query's position; the grouped
        output projection. Returns [n, H]."""
        c = self.cfg
        scores = torch.einsum("nhd,md->nhm", q, keys) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        sink = self.sinks.view(1, -1, 1).expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        o = torch.einsum("nhm,md->nhd", probs, keys)
        o = rope(o, positions, self.freqs, sign=-1.0)
        groups = o.reshape(o.shape[0], c.o_groups, -1)                           # [n, G, heads/G * D]
        wo_a = self.wo_a.view(c.o_groups, c.o_lora_rank, -1)
        return torch.einsum("ngi,goi->ngo", groups, wo_a).reshape(o.shape[0], -1) @ self.wo_b.t()

    def forward(self, streams: torch.Tensor, history: torch.Tensor, p0: int,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """streams [n, hc, H] of the block's positions p0 .. p0 + n - 1. DSPARK: every query sees
        `history` (the main-kv rows just before p0) and all n block rows (visible None). With
        `visible` [n, len(history) + n] another mask (check_against_transformers)."""
        c = self.cfg
        n = streams.shape[0]
        pos = torch.arange(p0, p0 + n)
        post, comb, y = hc_mix(streams, *self.hc_attn, c)
        h = rms_norm(y, self.attn_norm, c.eps)
        keys = torch.cat((history, self.kv(h, pos)), dim=0)
        if visible is None:
            visible = torch.ones(n, keys.shape[0], dtype=torch.bool)
        streams = hc_apply(streams, self.attend(self.queries(h, pos), keys, visible, pos), post, comb)
        post, comb, y = hc_mix(streams, *self.hc_ffn, c)
        return hc_apply(streams, self.mlp(rms_norm(y, self.ffn_norm, c.eps)), post, comb)


# ---------------------------------------------------------------------------------------------
# The drafter


@dataclass
class Draft:
    head_logits: torch.Tensor   # [B, V]: the trunk head over the block's normed states
    logits: torch.Tensor        # [B, V]: plus the Markov bias of the chain's token (argmax taken here)
    drafts: torch.Tensor        # [B] int64: t_1 .. t_B
    confidence: torch.Tensor    # [B]: the confidence logits c_0 .. c_{B-1} (c_j scores t_{j+1})
    length: int                 # the longest prefix with sigmoid(c) >= threshold
    prenorm: torch.Tensor       # [B, H]: hc_head's output (before the final norm)


class DsparkDrafter(torch.nn.Module):
    def __init__(self, cfg: DsparkConfig, tensors: dict, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        t = tensors
        last = f"mtp.{cfg.num_blocks - 1}."
        self.main_proj, self.main_norm = t["mtp.0.main_proj.weight"].float(), t["mtp.0.main_norm.weight"].float()
        self.blocks = torch.nn.ModuleList([DsparkBlock(cfg, t, i) for i in range(cfg.num_blocks)])
        self.hc_head = (t[last + "hc_head_fn"].float(), t[last + "hc_head_base"].float(),
                        t[last + "hc_head_scale"].float())
        self.norm = t[last + "norm.weight"].float()
        self.markov_w1 = t[last + "markov_head.markov_w1.weight"].float()
        self.markov_w2 = t[last + "markov_head.markov_w2.weight"].float()
        self.markov_b2 = t.get(last + "markov_head.markov_w2.bias")
        self.conf_w = t[last + "confidence_head.proj.weight"].float()
        self.conf_b = t.get(last + "confidence_head.proj.bias")
        self.embed, self.head = embed.float(), head.float()

    def project_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """main_x [n, H] from the taps [n, T * H]."""
        return rms_norm(taps.float() @ self.main_proj.t(), self.main_norm, self.cfg.eps)

    def main_kv(self, taps: torch.Tensor) -> list:
        """Each block's main-kv rows [n, D] of positions 0 .. n-1."""
        x = self.project_taps(taps)
        pos = torch.arange(x.shape[0])
        return [b.kv(x, pos) for b in self.blocks]

    def block_states(self, rows: list, seed: int, p0: int, history: int | None = None):
        """The block forward at p0: (prenorm [B, H], normed [B, H]). `history`: how many main-kv
        rows before p0 are read (default min(window, p0))."""
        c = self.cfg
        hist = min(c.window, p0) if history is None else history
        ids = torch.tensor([seed] + [c.noise_token_id] * (c.block_size - 1))
        streams = self.embed[ids].unsqueeze(1).repeat(1, c.hc_mult, 1)
        for block, r in zip(self.blocks, rows):
            streams = block(streams, r[p0 - hist: p0], p0)
        pre = hc_head(streams, *self.hc_head, c)
        return pre, rms_norm(pre, self.norm, c.eps)

    def markov_bias(self, token: int) -> torch.Tensor:
        b = self.markov_w2 @ self.markov_w1[token]
        return b if self.markov_b2 is None else b + self.markov_b2.float()

    def draft(self, rows: list, seed: int, p0: int, history: int | None = None, markov: bool = True) -> Draft:
        """One draft call: seed = the token at p0 (not in the cache), rows[i][:p0] its history."""
        c = self.cfg
        pre, normed = self.block_states(rows, seed, p0, history)
        head_logits = normed @ self.head.t()
        logits = head_logits.clone()
        chain, embs = [seed], []
        for j in range(c.block_size):
            embs.append(self.markov_w1[chain[-1]])
            if markov:
                logits[j] += self.markov_bias(chain[-1])
            chain.append(int(logits[j].argmax()))
        conf = torch.cat((pre, torch.stack(embs)), dim=-1) @ self.conf_w.t()
        conf = conf[:, 0] + (0.0 if self.conf_b is None else self.conf_b.float()[0])
        keep = torch.sigmoid(conf) >= c.conf_threshold
        length = int(torch.cumprod(keep.int(), 0).sum())
        return Draft(head_logits, logits, torch.tensor(chain[1:]), conf, length, pre)


# ---------------------------------------------------------------------------------------------
# The trunk's taps, and a check of this file's block against transformers'


def trunk_pass(model, ids: torch.Tensor, layer_ids: list):
    """One teacher-forced pass of transformers' DeepseekV4ForCausalLM over ids [n]: (taps [n, T * H],
    logits [n, V]). The taps: for each tapped layer (ascending), the mean over the hyper-connection
    streams of its output (the stream stack model.layers[L] returns)."""
    got = {}
    hooks = [model.model.layers[L].register_forward_hook(
        lambda mod, inp, out, L=L: got.__setitem__(L, (out[0] if isinstance(out, tuple) else out)[0].float()))
        for L in sorted(layer_ids)]
    try:
        with torch.no_grad():
            logits = model(ids.view(1, -1), use_cache=False).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[L].mean(dim=1) for L in sorted(layer_ids)], dim=-1), logits


def trunk_taps(model, ids: torch.Tensor, layer_ids: list) -> torch.Tensor:
    """trunk_pass's taps."""
    return trunk_pass(model, ids, layer_ids)[0]


def check_against_transformers(block: DsparkBlock, layer, rotary, n: int = 11, seed: int = 0) -> float:
    """The relative difference between this file's block (a causal sliding-window mask instead of
    DSPARK's) and transformers' DeepseekV4DecoderLayer `layer` (a sliding layer holding the same
    weights) on random streams [n, hc, H]; `rotary` the model's DeepseekV4RotaryEmbedding."""
    c = block.cfg
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c.hc_mult, c.hidden, generator=gen)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (j <= i) & (j > i - c.window)
    ours = block(x, x.new_zeros(0, c.head_dim), 0, visible)
    pos = torch.arange(n).view(1, -1)
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        emb = {k: rotary(x, pos, layer_type=k) for k in ("main", "compress")}
        theirs = layer(x.unsqueeze(0), position_embeddings=emb, position_ids=pos, attention_mask=mask,
                       input_ids=torch.zeros(1, n, dtype=torch.long))
    theirs = (theirs[0] if isinstance(theirs, tuple) else theirs)[0]
    return ((ours - theirs).norm() / theirs.norm()).item()
