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
- ModelArgs.hidden: 8/3·dim (floored, as Meta's Llama) rounded up to multiple_of.
"""

from __future__ import annotations

import math

import pytest
import torch

from kiln.model.llama import Llama, ModelArgs, RMSNorm, apply_rope, rope_tables


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(seed: int = 0, **kw) -> Llama:
    torch.manual_seed(seed)
    args = dict(vocab_size=50, dim=32, n_layers=2, n_heads=4, max_seq_len=64) | kw
    return Llama(ModelArgs(**args)).eval()


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
    a = model.args
    w = {k: v.detach().double() for k, v in model.state_dict().items()}
    H, KV = a.n_heads, a.n_kv_heads or a.n_heads
    hd, half = a.dim // H, a.dim // H // 2
    B, T = toks.shape
    ang = torch.arange(T, dtype=torch.float64)[:, None] * a.rope_theta ** (-2 * torch.arange(half, dtype=torch.float64) / hd)
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
    model = Llama(ModelArgs(**kw)).eval()
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
    assert hidden == m.args.hidden == 128
    per_layer = D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * hidden + 2 * D
    non_embedding_with_output = Lyr * per_layer + D + V * D  # final norm, output projection
    assert m.flops_per_token(seq) == 6 * non_embedding_with_output + 12 * Lyr * seq * D
    assert m.num_params(non_embedding=False) == non_embedding_with_output + (0 if tie else V * D)
    assert m.num_params() == non_embedding_with_output - (V * D if tie else 0)


@pytest.mark.parametrize("dim,multiple_of,want", [(256, 64, 704), (64, 64, 192), (8, 64, 64), (96, 256, 256),
                                                  (4096, 256, 11008), (8, 1, 21), (384, 64, 1024)])
def test_hidden_rounds_up_to_multiple_of(dim, multiple_of, want):
    assert ModelArgs(vocab_size=10, dim=dim, multiple_of=multiple_of).hidden == want


def test_hidden_properties_and_override():
    for dim in range(8, 600, 8):
        for mult in (1, 8, 32, 64, 256):
            h = ModelArgs(vocab_size=10, dim=dim, multiple_of=mult).hidden
            base = int(8 * dim / 3)  # Meta's Llama: int(2 * 4 * dim / 3), then up to a multiple
            assert h % mult == 0 and base <= h < base + mult
    assert ModelArgs(vocab_size=10, dim=256, ffn_hidden=100).hidden == 100
    m = build(dim=32, ffn_hidden=40)
    assert m.layers[0].feed_forward.w1.weight.shape == (40, 32)
