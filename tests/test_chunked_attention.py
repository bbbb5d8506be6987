"""The chunked attention op (FPDT's compute core) against PyTorch SDPA in float64."""

import pytest
import torch
import torch.nn.functional as F

from longtrain.ops.chunked_attention import chunked_attention

TOL = 1e-10


def reference(q, k, v, window=None, segments=None):
    s = q.shape[2]
    pos = torch.arange(s)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask = mask & (pos[None, :] > pos[:, None] - window)
    mask = mask[None, None]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])[:, None]
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("n_chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("variant", ["causal", "window", "packed"])
def test_matches_sdpa_in_float64(heads, kv_heads, n_chunks, variant):
    s = 61  # not divisible by any chunk count above 1
    chunk = -(-s // n_chunks)
    g = torch.Generator().manual_seed(n_chunks * 10 + heads + kv_heads)
    q = torch.randn(2, heads, s, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, s, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, s, 16, dtype=torch.float64, generator=g, requires_grad=True)
    window = 13 if variant == "window" else None
    segments = None
    if variant == "packed":
        segments = torch.zeros(2, s, dtype=torch.long)
        segments[0, 20:] = 1
        segments[1, 7:] = 1
        segments[1, 40:] = 2
    out = chunked_attention(q, k, v, chunk=chunk, window=window, segments=segments)
    ref = reference(q, k, v, window, segments)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel(out, ref) <= TOL
    assert max(rel(a, b) for a, b in zip(got, expected)) <= TOL


def test_bf16_within_tolerance():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 200, 32, generator=g, dtype=torch.float64) for _ in range(3))
    exact = reference(q, k, v)
    out = chunked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), chunk=48)
    assert rel(out.double(), exact) <= 1e-2


def test_bad_head_counts():
    q = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        chunked_attention(q, torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), chunk=4)


@pytest.mark.parametrize("n_chunks", [1, 3])
def test_soft_capped_attention_matches_explicit_scores_in_float64(n_chunks):
    """Gemma-2's logit soft-capping c·tanh(s/c), GQA, a window cutting across chunks."""
    s, cap, window = 45, 5.0, 11
    g = torch.Generator().manual_seed(n_chunks)
    q = torch.randn(2, 4, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, s, 8, dtype=torch.float64, generator=g, requires_grad=True)
    out = chunked_attention(q, k, v, chunk=-(-s // n_chunks), window=window, softcap=cap, scale=0.7)
    scores = torch.tanh(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.7 / cap) * cap
    pos = torch.arange(s)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel(out, ref) <= TOL
    assert max(rel(a, b) for a, b in zip(got, expected)) <= TOL
