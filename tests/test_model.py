"""The Llama model: shapes, causality, grouped-query attention, RoPE, RMSNorm, tying, init, a known answer, FLOPs.

Covered (CPU, one torch thread, tiny models):
- logits shapes for GQA (n_kv_heads < n_heads) and MHA; K/V projection widths;
  sequences longer than max_seq_len raise ValueError;
- causality: changing token t leaves the logits before t unchanged (and changes t's);
- GQA == MHA whose K/V heads are the GQA heads repeated (repeat_interleave grouping);
  n_kv_heads == n_heads is the same model as n_kv_heads=None;
- RoPE: cos²+sin²=1, the table's angles are pos·theta^(-2i/d) in the rotate-half
  layout, apply_rope preserves norms, and q·k after RoPE depends only on m-n;
- RMSNorm: unit RMS with weight 1, scaled by the weight, equals x/sqrt(mean x²+eps);
- tied embeddings share one tensor (counted once), untied do not;
- init: N(0, init_std²), wo/w2 scaled by 1/sqrt(2·n_layers), norms 1;
- a known-answer forward pass against an independent float64 re-implementation
  (explicit matmuls, causal-mask softmax, rotate-half RoPE, repeat_interleave GQA);
- flops_per_token = 6·(non-embedding params incl. output) + 12·layers·seq·dim (PaLM appendix B), by hand;
- ModelConfig.hidden: 8/3·dim (floored, as Meta's Llama) rounded up to multiple_of;
- RoPE scaling: factor 1 leaves tables and logits bitwise unchanged (linear, llama3); linear factor k at
  position k·p equals unscaled p; llama3 equals Meta's reference loop on Llama 3.1's settings, all three regimes;
- MoE: the vectorised block equals a float64 token-by-token reference (top-1/2/3, dropless and with drops);
  top-k = argmax-k of the logits, weights renormalised (top-1: the probability); capacity formula; first
  choices served before second; drops counted exactly and their expert output zero on a constructed case;
  aux loss 1 when balanced, E·p when collapsed; z-loss on known logits; gradients reach routers and experts;
  Mixtral-like names and shapes, every_n_layers placement, init; moe_losses summed over layers, zero when dense;
  bf16 autocast; an MoE model's loss falls in 30 steps; flops_per_token counts active parameters by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

import torch.nn.functional as F

from kiln.model.config import ModelConfig, MoEConfig, RopeScalingConfig
from kiln.model.llama import Llama, RMSNorm, apply_rope, rope_tables, scale_frequencies
from kiln.model.moe import (MoEFeedForward, expert_capacity, load_balancing_loss, route,
                            router_z_loss)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def llama(vocab_size: int, max_seq_len: int = 2048, **model_keys) -> Llama:
    """A Llama from model: keys, the vocabulary and the longest sequence (the model's own config)."""
    return Llama(ModelConfig(**model_keys), vocab_size=vocab_size, max_seq_len=max_seq_len)


def build(seed: int = 0, **kw) -> Llama:
    torch.manual_seed(seed)
    return llama(**(dict(vocab_size=50, dim=32, n_layers=2, n_heads=4, max_seq_len=64) | kw)).eval()


def tokens(b: int, t: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


# --- shapes and causality ----------------------------------------------------------------------

@pytest.mark.parametrize("kv", [None, 4, 2, 1])
def test_output_shapes_gqa_and_mha(kv):
    m = build(n_kv_heads=kv)
    with torch.no_grad():
        out = m(tokens(3, 11, 50))
    assert out.shape == (3, 11, 50) and out.dtype == torch.float32 and torch.isfinite(out).all()
    a = m.layers[0].attention
    kvh = kv or 4
    assert a.wq.weight.shape == (4 * 8, 32) and a.wo.weight.shape == (32, 4 * 8)
    assert a.wk.weight.shape == a.wv.weight.shape == (kvh * 8, 32)


def test_sequence_longer_than_max_seq_len_raises():
    m = build(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        m(tokens(1, 9, 50))


@pytest.mark.parametrize("kv", [None, 2])
def test_causality(kv):
    m = build(n_kv_heads=kv)
    x = tokens(2, 16, 50)
    with torch.no_grad():
        base = m(x)
        for t in (0, 5, 15):
            y = x.clone()
            y[:, t] = (y[:, t] + 7) % 50
            out = m(y)
            assert torch.allclose(out[:, :t], base[:, :t], atol=1e-6, rtol=0), f"position {t} leaked backwards"
            assert (out[:, t] - base[:, t]).abs().max() > 1e-4  # the changed position itself does change


# --- grouped-query attention ---------------------------------------------------------------------

def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build(seed=3, n_heads=4, n_kv_heads=2, init_std=0.3)
    mha = build(seed=4, n_heads=4, n_kv_heads=4, init_std=0.3)
    sd = gqa.state_dict()
    hd, group = 8, 2
    for k in list(sd):
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            w = sd[k].view(2, hd, 32)  # (kv heads, head_dim, dim)
            sd[k] = w.repeat_interleave(group, dim=0).reshape(4 * hd, 32)  # query head h uses kv head h // group
    mha.load_state_dict(sd)
    x = tokens(2, 20, 50)
    with torch.no_grad():
        assert torch.allclose(gqa(x), mha(x), atol=1e-5, rtol=1e-5)
        # tiling the kv heads instead (head h -> kv head h % n_kv) is a different model
        bad = gqa.state_dict()
        for k in list(bad):
            if k.endswith(("attention.wk.weight", "attention.wv.weight")):
                bad[k] = bad[k].view(2, hd, 32).repeat(group, 1, 1).reshape(4 * hd, 32)
        mha.load_state_dict(bad)
        assert not torch.allclose(gqa(x), mha(x), atol=1e-4)


def test_n_kv_heads_equal_to_n_heads_is_mha():
    a, b = build(seed=9, n_kv_heads=None), build(seed=9, n_kv_heads=4)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    x = tokens(2, 12, 50)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


# --- RoPE --------------------------------------------------------------------------------------

def test_rope_tables_unit_circle_and_angles():
    hd, T, theta = 16, 100, 10000.0
    cos, sin = rope_tables(hd, T, theta)
    assert cos.shape == sin.shape == (T, hd) and cos.dtype == torch.float32
    assert torch.allclose(cos ** 2 + sin ** 2, torch.ones(T, hd), atol=1e-6)
    assert torch.equal(cos[:, :hd // 2], cos[:, hd // 2:]) and torch.equal(sin[:, :hd // 2], sin[:, hd // 2:])
    assert torch.equal(cos[0], torch.ones(hd)) and torch.equal(sin[0], torch.zeros(hd))
    for p in (1, 7, 99):
        for i in range(hd // 2):
            angle = p * theta ** (-2 * i / hd)
            assert cos[p, i].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert sin[p, i].item() == pytest.approx(math.sin(angle), abs=1e-6)


def rotate(x: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (head_dim,) rotated as if it sat at position `pos`."""
    return apply_rope(x.view(1, 1, 1, -1), cos[pos:pos + 1], sin[pos:pos + 1]).view(-1)


def test_apply_rope_preserves_norms_and_pairs():
    hd, T = 16, 64
    cos, sin = rope_tables(hd, T, 10000.0)
    x = torch.randn(2, 3, T, hd, generator=torch.Generator().manual_seed(0))
    y = apply_rope(x, cos, sin)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    half = hd // 2
    pair_x = x[..., :half] ** 2 + x[..., half:] ** 2  # each (i, i + half) pair is rotated as a 2-vector
    pair_y = y[..., :half] ** 2 + y[..., half:] ** 2
    assert torch.allclose(pair_x, pair_y, rtol=1e-4, atol=1e-6)
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    xb = x.to(torch.bfloat16)
    assert apply_rope(xb, cos, sin).dtype == torch.bfloat16


def test_rope_score_depends_only_on_relative_position():
    hd = 16
    cos, sin = rope_tables(hd, 256, 10000.0)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    for m, n in [(0, 0), (5, 2), (2, 5), (17, 3)]:
        ref = torch.dot(rotate(q, m, cos, sin), rotate(k, n, cos, sin))
        for s in (1, 10, 100, 200):
            got = torch.dot(rotate(q, m + s, cos, sin), rotate(k, n + s, cos, sin))
            assert got.item() == pytest.approx(ref.item(), abs=1e-4)
    # and it does depend on the relative offset itself
    a = torch.dot(rotate(q, 3, cos, sin), rotate(k, 0, cos, sin))
    b = torch.dot(rotate(q, 9, cos, sin), rotate(k, 0, cos, sin))
    assert abs(a.item() - b.item()) > 1e-3


# --- RMSNorm, tying, init --------------------------------------------------------------------------

def test_rmsnorm_unit_rms_and_weight():
    norm = RMSNorm(64, eps=1e-5)
    x = 7.0 * torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(0)) + 3.0
    y = norm(x)
    rms = y.pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-5)
    assert torch.allclose(y, x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), atol=1e-6)
    with torch.no_grad():
        norm.weight.fill_(2.5)
    assert torch.allclose(norm(x).pow(2).mean(-1).sqrt(), torch.full_like(rms, 2.5), atol=1e-4)
    z = norm(torch.zeros(2, 64))  # eps keeps the all-zero vector finite
    assert torch.equal(z, torch.zeros(2, 64))


def test_tied_embeddings_share_one_tensor():
    tied, untied = build(tie_embeddings=True), build(tie_embeddings=False)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 50 * 32
    with torch.no_grad():
        tied.tok_embeddings.weight[3, 0] += 1.0
    assert tied.output.weight[3, 0] == tied.tok_embeddings.weight[3, 0]
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1


def test_init_std_and_residual_scaling():
    n_layers, std = 4, 0.02
    m = build(seed=0, vocab_size=512, dim=256, n_layers=n_layers, n_heads=4, init_std=std)
    resid = std / math.sqrt(2 * n_layers)
    seen = set()
    for name, p in m.named_parameters():
        seen.add(name.rsplit(".", 2)[-2])
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        want = resid if name.endswith(("wo.weight", "w2.weight")) else std
        assert p.std().item() == pytest.approx(want, rel=0.05), name
        assert abs(p.mean().item()) < want / 10, name
    assert {"wq", "wk", "wv", "wo", "w1", "w2", "w3", "tok_embeddings", "output"} <= seen


# --- a known answer --------------------------------------------------------------------------------

def reference_logits(model: Llama, toks: torch.Tensor) -> torch.Tensor:
    """Straightforward float64 Llama: explicit matmuls, masked softmax, rotate-half RoPE, repeated kv heads."""
    a = model.config
    w = {k: v.detach().double() for k, v in model.state_dict().items()}
    H, KV = a.n_heads, a.n_kv_heads or a.n_heads
    hd, half = a.dim // H, a.dim // H // 2
    B, T = toks.shape
    ang = torch.arange(T, dtype=torch.float64)[:, None] * a.rope_theta ** (
        -2 * torch.arange(half, dtype=torch.float64) / hd
    )
    c, s = torch.cos(ang), torch.sin(ang)

    def rms(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + a.norm_eps) * g

    def rope(x):  # (B, heads, T, hd): pair (i, i + half) rotated by angle pos * theta^(-2i/hd)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def heads(x, n):
        return x.reshape(B, T, n, hd).permute(0, 2, 1, 3)

    x = w["tok_embeddings.weight"][toks]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for i in range(a.n_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "attention_norm.weight"])
        q = rope(heads(h @ w[p + "attention.wq.weight"].T, H))
        k = rope(heads(h @ w[p + "attention.wk.weight"].T, KV)).repeat_interleave(H // KV, dim=1)
        v = heads(h @ w[p + "attention.wv.weight"].T, KV).repeat_interleave(H // KV, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(mask, float("-inf"))
        att = torch.exp(scores - scores.max(-1, keepdim=True).values)
        att = att / att.sum(-1, keepdim=True)
        o = (att @ v).permute(0, 2, 1, 3).reshape(B, T, H * hd)
        x = x + o @ w[p + "attention.wo.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "feed_forward.w1.weight"].T, h @ w[p + "feed_forward.w3.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "feed_forward.w2.weight"].T
    return rms(x, w["norm.weight"]) @ w["output.weight"].T


KNOWN = {
    "tiny_mha": dict(vocab_size=16, dim=8, n_layers=1, n_heads=2),
    "tiny_default_init": dict(vocab_size=16, dim=8, n_layers=1, n_heads=2, init_std=0.02),
    "gqa_tied_2layers": dict(vocab_size=16, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=True),
    "mqa_theta": dict(vocab_size=16, dim=16, n_layers=1, n_heads=4, n_kv_heads=1, rope_theta=100.0, multiple_of=8),
}


@pytest.mark.parametrize("case", sorted(KNOWN))
def test_known_answer_forward(case):
    kw = {"init_std": 0.5, "max_seq_len": 32} | KNOWN[case]
    torch.manual_seed(0)
    model = llama(**kw).eval()
    toks = torch.tensor([[1, 5, 3, 15, 0, 7, 7, 2, 9, 11], [4, 4, 4, 12, 13, 14, 0, 1, 2, 3]])
    with torch.no_grad():
        got = model(toks).double()
    want = reference_logits(model, toks)
    assert got.shape == want.shape == (2, 10, 16)
    assert want.abs().max() > (1e-3 if kw["init_std"] < 0.1 else 0.1)  # not a trivially tiny answer
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max().item()


# --- arithmetic --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv", [None, 2])
def test_flops_per_token_by_hand(tie, kv):
    V, D, Lyr, H, seq = 100, 48, 3, 6, 128
    m = build(vocab_size=V, dim=D, n_layers=Lyr, n_heads=H, n_kv_heads=kv, tie_embeddings=tie, multiple_of=32)
    hd, KV = D // H, kv or H
    hidden = 32 * math.ceil(int(8 * D / 3) / 32)
    assert hidden == m.config.hidden == 128
    per_layer = D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * hidden + 2 * D
    non_embedding_with_output = Lyr * per_layer + D + V * D  # final norm, output projection
    assert m.flops_per_token(seq) == 6 * non_embedding_with_output + 12 * Lyr * seq * D
    assert m.num_params(non_embedding=False) == non_embedding_with_output + (0 if tie else V * D)
    assert m.num_params() == non_embedding_with_output - (V * D if tie else 0)


@pytest.mark.parametrize("dim,multiple_of,want", [(256, 64, 704), (64, 64, 192), (8, 64, 64), (96, 256, 256),
                                                  (4096, 256, 11008), (8, 1, 21), (384, 64, 1024)])
def test_hidden_rounds_up_to_multiple_of(dim, multiple_of, want):
    assert ModelConfig(dim=dim, multiple_of=multiple_of).hidden == want


def test_hidden_properties_and_override():
    for dim in range(8, 600, 8):
        for mult in (1, 8, 32, 64, 256):
            h = ModelConfig(dim=dim, multiple_of=mult).hidden
            base = int(8 * dim / 3)  # Meta's Llama: int(2 * 4 * dim / 3), then up to a multiple
            assert h % mult == 0 and base <= h < base + mult
    assert ModelConfig(dim=256, ffn_hidden=100).hidden == 100
    m = build(dim=32, ffn_hidden=40)
    assert m.layers[0].feed_forward.w1.weight.shape == (40, 32)


# --- RoPE position scaling ---------------------------------------------------------------------------

def meta_llama3_scaling(freqs: list[float], factor: float, low: float, high: float, old_len: int) -> list[float]:
    """Meta's reference (llama-models, apply_scaling), transcribed as a plain loop."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_rope_scaling_factor_one_is_identity(kind):
    plain = rope_tables(32, 300, 10000.0)
    scaled = rope_tables(32, 300, 10000.0, RopeScalingConfig(type=kind, factor=1.0, original_max_seq_len=64))
    assert torch.equal(plain[0], scaled[0]) and torch.equal(plain[1], scaled[1])
    a = build(seed=5, init_std=0.3)
    b = build(seed=5, init_std=0.3, rope_scaling=RopeScalingConfig(type=kind, factor=1.0, original_max_seq_len=16))
    x = tokens(2, 40, 50)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("factor", [2, 4, 8])
def test_rope_linear_scaling_interpolates_positions(factor):
    hd, T = 16, 64
    cos, sin = rope_tables(hd, T, 10000.0)
    cos_s, sin_s = rope_tables(hd, T * factor, 10000.0, RopeScalingConfig(type="linear", factor=float(factor)))
    p = torch.arange(T)
    assert torch.allclose(cos_s[factor * p], cos, atol=1e-6, rtol=0)
    assert torch.allclose(sin_s[factor * p], sin, atol=1e-6, rtol=0)
    assert not torch.allclose(cos_s[:T], cos, atol=1e-3)  # and it is not the unscaled table


def test_rope_llama3_scaling_matches_meta_reference():
    hd, theta = 128, 500000.0  # Llama 3.1: factor 8, low 1, high 4, trained at 8192
    s = RopeScalingConfig(type="llama3", factor=8.0, original_max_seq_len=8192, low_freq_factor=1.0,
                          high_freq_factor=4.0)
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    got = scale_frequencies(inv_freq, s)
    want = torch.tensor(meta_llama3_scaling(inv_freq.tolist(), 8.0, 1.0, 4.0, 8192), dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    wavelength = 2 * math.pi / inv_freq
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert short.sum() > 10 and long.sum() > 10 and (~short & ~long).sum() > 0  # all three regimes occur
    assert torch.equal(got[short], inv_freq[short])
    assert torch.allclose(got[long], inv_freq[long] / 8, rtol=1e-15)
    mid = ~short & ~long
    assert ((got[mid] < inv_freq[mid]) & (got[mid] > inv_freq[mid] / 8)).all()
    cos, _ = rope_tables(hd, 16, theta, s)
    assert cos[7, 0].item() == pytest.approx(math.cos(7 * got[0].item()), abs=1e-6)
    assert cos[7, hd // 2 - 1].item() == pytest.approx(math.cos(7 * got[-1].item()), abs=1e-6)


def test_rope_scaling_rejects_unknown_type_and_bad_factors():
    with pytest.raises(ValueError, match="'yarn'"):
        RopeScalingConfig(type="yarn", factor=2.0)
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScalingConfig(type="llama3", factor=2.0, low_freq_factor=4.0, high_freq_factor=1.0)


# --- mixture of experts -------------------------------------------------------------------------------

def moe_args(**kw) -> MoEConfig:
    return MoEConfig(**({"n_experts": 4, "top_k": 2, "capacity_factor": None} | kw))


def make_moe(dim: int = 8, hidden: int = 12, seed: int = 0, std: float = 0.5, **kw) -> MoEFeedForward:
    torch.manual_seed(seed)
    ff = MoEFeedForward(dim, hidden, moe_args(**kw))
    with torch.no_grad():
        for p in ff.parameters():
            p.normal_(0, std)
    return ff


def reference_moe(ff: MoEFeedForward, x: torch.Tensor, capacity: int) -> tuple[torch.Tensor, int]:
    """float64, token by token: softmax, top-k, renormalised weights; first choices served before second."""
    x = x.double().reshape(-1, x.shape[-1])
    n, E, k = x.shape[0], ff.n_experts, ff.top_k
    probs = torch.softmax(x @ ff.router.weight.double().T, -1)
    w1, w3, w2 = (p.double() for p in (ff.experts.w1, ff.experts.w3, ff.experts.w2))
    choices = [sorted(range(E), key=lambda e: -probs[i, e].item())[:k] for i in range(n)]
    used, dropped, out = [0] * E, 0, torch.zeros_like(x)
    for rank in range(k):
        for i in range(n):
            e = choices[i][rank]
            if used[e] == capacity:
                dropped += 1
                continue
            used[e] += 1
            weight = probs[i, e] / sum(probs[i, c] for c in choices[i]) if k > 1 else probs[i, e]
            gate, up = w1[e] @ x[i], w3[e] @ x[i]
            out[i] += weight * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    return out, dropped


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (2, 1.0), (1, 1.0), (3, 0.5)])
def test_moe_forward_matches_token_by_token_reference(top_k, capacity_factor):
    ff = make_moe(top_k=top_k, capacity_factor=capacity_factor, seed=top_k)
    x = torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = ff(x)
    capacity = expert_capacity(21, top_k, 4, capacity_factor)
    want, dropped = reference_moe(ff, x, capacity)
    assert got.shape == x.shape
    assert torch.allclose(got.double().reshape(-1, 8), want, atol=1e-5, rtol=1e-5)
    assert ff.stats["dropped_tokens"].item() == dropped and ff.stats["routed_tokens"] == 21 * top_k
    if capacity_factor is None:
        assert dropped == 0
    elif capacity_factor < 1 or top_k == 1:
        assert dropped > 0  # the capacity actually bit in these cases


def test_route_picks_argmax_k_with_weights_summing_to_one():
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(0)) * 3
    for k in (1, 2, 3):
        r = route(logits, k, capacity=50)
        want = logits.argsort(-1, descending=True)[:, :k]
        assert torch.equal(r.experts, want)
        assert torch.allclose(r.probs, logits.softmax(-1))
        if k == 1:  # Switch: the probability itself, so the LM loss reaches the router
            assert torch.equal(r.weights[:, 0], r.probs.max(-1).values)
        else:
            assert torch.allclose(r.weights.sum(-1), torch.ones(50), atol=1e-6)
            assert torch.allclose(r.weights, r.probs.gather(1, want) / r.probs.gather(1, want).sum(-1, keepdim=True))
        assert r.kept.all() and r.counts.sum() == 50 * k
        assert torch.equal(r.counts, torch.bincount(want.reshape(-1), minlength=6))


def test_capacity_formula():
    assert expert_capacity(16, 2, 8, 1.25) == 5  # ceil(1.25 · 16 · 2 / 8) = 5
    assert expert_capacity(10, 1, 1, 1.1) == 11 - 1  # ceil(11) capped at the 10 tokens there are
    assert expert_capacity(100, 1, 10, 1.1) == 11  # not 12 from 11.000000000000002
    assert expert_capacity(9, 2, 4, 1.0) == 5  # ceil(4.5)
    assert expert_capacity(9, 2, 4, None) == 9


def test_route_capacity_serves_first_choices_first():
    # token 0 prefers (0, 1), token 1 prefers (1, 0), token 2 prefers (0, 1); each expert takes 2 assignments
    logits = torch.tensor([[3.0, 2.0, 0.0], [2.0, 3.0, 0.0], [3.0, 2.0, 0.0]])
    r = route(logits, 2, capacity=2)
    assert r.experts.tolist() == [[0, 1], [1, 0], [0, 1]]
    # first choices: e0 <- t0, t2 (slots 0, 1); e1 <- t1 (slot 0); then second choices: t0 -> e1 slot 1,
    # t1 -> e0 slot 2 (dropped), t2 -> e1 slot 2 (dropped)
    assert r.position.tolist() == [[0, 1], [0, 2], [1, 2]]
    assert r.kept.tolist() == [[True, True], [True, False], [True, False]]
    assert r.counts.tolist() == [3, 3, 0]


def test_dropped_tokens_counted_and_passed_through_by_the_residual():
    ff = make_moe(dim=4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        ff.router.weight.copy_(10 * torch.eye(4))  # a one-hot token e routes to expert e
    choice = [0, 0, 0, 1, 1, 2, 0, 3]  # expert 0 is chosen 4 times; capacity = ceil(8 · 1 / 4) = 2
    x = F.one_hot(torch.tensor(choice), 4).float().view(1, 8, 4)
    with torch.no_grad():
        y = ff(x)[0]
    assert ff.stats["dropped_tokens"].item() == 2 and ff.stats["routed_tokens"] == 8
    zero_rows = [i for i in range(8) if torch.equal(y[i], torch.zeros(4))]
    assert zero_rows == [2, 6]  # expert 0's third and fourth tokens: dropped, the expert adds nothing
    kept = [i for i in range(8) if i not in (2, 6)]
    probs = torch.softmax(10.0 * torch.eye(4)[choice], -1).max(-1).values
    with torch.no_grad():
        expert_out = ff.experts(x[0].unsqueeze(0).expand(4, 8, 4))  # every expert on every token
    want = torch.stack([probs[i] * expert_out[choice[i], i] for i in kept])
    assert torch.allclose(y[kept], want, atol=1e-6)


def test_load_balancing_loss_is_one_when_balanced_and_higher_when_not():
    E, n = 4, 64
    uniform = torch.full((n, E), 1 / E)
    assert load_balancing_loss(uniform, torch.full((E,), n // E)).item() == pytest.approx(1.0, abs=1e-7)
    # balanced routing with confident tokens: each expert gets a quarter, the mean probability is uniform
    logits = 5 * F.one_hot(torch.arange(n) % E, E).float()
    r = route(logits, 1, capacity=n)
    assert load_balancing_loss(r.probs, r.counts).item() == pytest.approx(1.0, abs=1e-6)
    # every token picks expert 0 with probability p: f = (1, 0, 0, 0), loss = E · p
    skew = route(torch.tensor([[2.0, 0.0, 0.0, 0.0]]).repeat(n, 1), 1, capacity=n)
    p = math.exp(2) / (math.exp(2) + 3)
    assert load_balancing_loss(skew.probs, skew.counts).item() == pytest.approx(E * p, rel=1e-6)
    assert E * p > 2
    half = route(5 * F.one_hot(torch.arange(n) % 2, E).float(), 1, capacity=n)  # two experts share everything
    assert 1.5 < load_balancing_loss(half.probs, half.counts).item() < E * p


def test_router_z_loss_known_value():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: ln 2 and ln 4 = 2 ln 2
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + 4 * math.log(2) ** 2) / 2, rel=1e-6)
    assert router_z_loss(torch.zeros(5, 8)).item() == pytest.approx(math.log(8) ** 2, rel=1e-6)


def test_moe_gradients_reach_router_and_every_used_expert():
    model = build(moe=moe_args(capacity_factor=1.25), init_std=0.1).train()
    x = tokens(4, 16, 50)
    logits = model(x)
    losses = model.moe_losses()
    loss = F.cross_entropy(logits.flatten(0, 1), x.flatten()) + 0.01 * losses["aux_loss"] + 0.001 * losses["z_loss"]
    loss.backward()
    for layer in model.layers:
        ff = layer.feed_forward
        assert ff.router.weight.grad.abs().sum() > 0
        for w in (ff.experts.w1, ff.experts.w3, ff.experts.w2):
            per_expert = w.grad.abs().flatten(1).sum(1)
            assert (per_expert > 0).all(), per_expert  # 64 tokens, 4 experts: every expert is used
    # the auxiliary losses alone train the routers; the last layer's experts feed no router, so get nothing
    model.zero_grad(set_to_none=True)
    model(x)
    aux = model.moe_losses()
    (aux["aux_loss"] + aux["z_loss"]).backward()
    assert all(layer.feed_forward.router.weight.grad.abs().sum() > 0 for layer in model.layers)
    assert model.layers[-1].feed_forward.experts.w1.grad is None
    assert model.layers[0].feed_forward.experts.w1.grad.abs().sum() > 0  # layer 1's router reads its output


def test_moe_layout_names_placement_and_init():
    model = build(seed=0, vocab_size=64, dim=64, n_layers=3, n_heads=4, init_std=0.02,
                  moe=MoEConfig(n_experts=8, top_k=2, every_n_layers=2, ffn_hidden=96))
    names = dict(model.named_parameters())
    for i in (0, 2):  # layers 0 and 2 are MoE (i % 2 == 0), layer 1 stays dense
        assert names[f"layers.{i}.feed_forward.router.weight"].shape == (8, 64)
        assert names[f"layers.{i}.feed_forward.experts.w1"].shape == (8, 96, 64)
        assert names[f"layers.{i}.feed_forward.experts.w3"].shape == (8, 96, 64)
        assert names[f"layers.{i}.feed_forward.experts.w2"].shape == (8, 64, 96)
        assert f"layers.{i}.feed_forward.w1.weight" not in names
    assert names["layers.1.feed_forward.w1.weight"].shape == (model.config.hidden, 64)
    assert "layers.1.feed_forward.router.weight" not in names
    resid = 0.02 / math.sqrt(2 * 3)
    assert names["layers.0.feed_forward.experts.w2"].std().item() == pytest.approx(resid, rel=0.05)
    assert names["layers.0.feed_forward.experts.w1"].std().item() == pytest.approx(0.02, rel=0.05)
    assert names["layers.2.feed_forward.router.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert len(build(moe=MoEConfig(n_experts=0)).moe_layers()) == 0
    with pytest.raises(ValueError, match="top_k=5"):
        build(moe=MoEConfig(n_experts=4, top_k=5))


def test_moe_losses_are_zero_for_a_dense_model_and_summed_over_layers():
    dense = build()
    with torch.no_grad():
        dense(tokens(2, 8, 50))
    d = dense.moe_losses()
    assert d["aux_loss"].item() == 0 and d["z_loss"].item() == 0 and d["dropped_tokens"] == d["routed_tokens"] == 0
    moe = build(n_layers=3, moe=moe_args(capacity_factor=0.5))
    assert moe.moe_losses()["routed_tokens"] == 0  # before any forward
    with torch.no_grad():
        moe(tokens(2, 8, 50))
    got = moe.moe_losses()
    stats = [layer.feed_forward.stats for layer in moe.layers]
    assert got["aux_loss"].item() == pytest.approx(sum(s["aux_loss"].item() for s in stats), rel=1e-6)
    assert got["z_loss"].item() == pytest.approx(sum(s["z_loss"].item() for s in stats), rel=1e-6)
    assert got["dropped_tokens"] == sum(int(s["dropped_tokens"]) for s in stats) > 0
    assert got["routed_tokens"] == 3 * 16 * 2
    assert 1.0 <= got["aux_loss"].item() / 3 <= 4.0  # each layer's loss lies between balanced and collapsed


def test_moe_runs_under_bf16_autocast_with_fp32_router():
    model = build(moe=moe_args(capacity_factor=1.25))
    x = tokens(2, 8, 50)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert model.moe_losses()["aux_loss"].dtype == torch.float32
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_moe_model_trains():
    torch.manual_seed(0)
    V, T = 32, 16
    model = llama(vocab_size=V, dim=32, n_layers=2, n_heads=4, max_seq_len=T,
                  moe=MoEConfig(n_experts=4, top_k=2, capacity_factor=1.25))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):  # next token = previous + stride (a per-sequence stride in 1..3): learnable from context
        start = torch.randint(0, V, (8, 1), generator=g)
        stride = torch.randint(1, 4, (8, 1), generator=g)
        seq = (start + stride * torch.arange(T + 1)) % V
        logits = model(seq[:, :-1])
        aux = model.moe_losses()
        lm = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
        (lm + 0.01 * aux["aux_loss"] + 0.001 * aux["z_loss"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(lm.item())
    assert losses[0] == pytest.approx(math.log(V), rel=0.1)
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_counts_active_parameters(tie):
    V, D, Lyr, H, seq, E, k, he = 100, 48, 3, 6, 128, 8, 2, 40
    m = build(vocab_size=V, dim=D, n_layers=Lyr, n_heads=H, tie_embeddings=tie, multiple_of=32,
              moe=MoEConfig(n_experts=E, top_k=k, every_n_layers=2, ffn_hidden=he))
    hidden = 128
    attention_and_norms = 4 * D * D + 2 * D
    dense_layer = attention_and_norms + 3 * D * hidden
    moe_all = attention_and_norms + D * E + E * 3 * D * he
    moe_active = attention_and_norms + D * E + k * 3 * D * he
    head = D + V * D  # final norm, output projection
    assert m.num_params(non_embedding=False) == 2 * moe_all + dense_layer + head + (0 if tie else V * D)
    assert m.active_params() == 2 * moe_active + dense_layer + head
    assert m.flops_per_token(seq) == 6 * (2 * moe_active + dense_layer + head) + 12 * Lyr * seq * D
