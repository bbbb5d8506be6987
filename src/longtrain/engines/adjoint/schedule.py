"""The ``adjoint`` engine's step: adjoint sharding for state-space models (exact or truncated).

Paper: the adjoint sharding paper (Prop. 2–3, §4.3, Alg. 1–4). No
backpropagation-through-time graph is built. The forward runs without autograd and
keeps, per layer, the layer's input y_{k−1} (the residual stream) — and, with
``recompute=False``, the rest of what the paper lists: A, c (the input-dependent part
of C) and h; by default those are rebuilt from y_{k−1} when the layer's turn comes, a
scan chunk at a time from the state entering the chunk, which the forward keeps (so no
layer's states exist over the whole sequence). With ``offload_inputs`` the inputs wait in pinned host memory, each fetched while the
layer above runs its backward. The gradient then goes down the stack one layer at a time:

1. ``g = ∂L/∂z_k`` is the gradient of the residual stream at the layer's output. It is
   what Prop. 3 must use for layer k; the paper prints ∂L/∂y_K (the top of the stack)
   for every layer, which is exact only for the top one.
2. The adjoint states. Token i's parameters reach the loss at every t ≥ i through
   λ^{t,i} = C^t A^t ⋯ A^{i+1}; the VJP vector of token i's A and B networks is
   μ^i = Σ_t g^t λ^{t,i}. Because a VJP is linear in its vector, the T(T+1)/2 VJPs
   of Prop. 3 collapse into T: exactly, μ is the reverse recurrence
   μ^i = C^{iT} g^i + A^{i+1} ⊙ μ^{i+1} (a log-depth scan); truncated to T̄, the sum
   keeps t − i < T̄ and is accumulated over the T̄ offsets — T̄·T − T̄(T̄−1)/2 terms,
   linear in T (``AdjointStats.adjoint_terms`` counts them).
3. Token-wise VJPs. With h^{i−1}, h^i held fixed, token i's contribution is the map
   ``Recurrence.local``: (A^i h^{i−1} + B^i x^i, C^i h^i). Its VJP with cotangents
   (μ^i, g^i) gives token i's parameter gradient (A and B networks see μ^i ⊗ h^{i−1} and
   μ^i ⊗ x^i, the C network g^i ⊗ h^i, as in Prop. 2) and the gradient of its input.
   The per-token VJPs are independent; a block of tokens (sized to ``vjp_memory``)
   takes them in one backward of the layer's map over the block. The layer is read
   through its adapter's :class:`~longtrain.ops.recurrence.Recurrence` (SSM-ResNet,
   Mamba, Mamba-2); where a token's map reads the ``window`` tokens before it (Mamba's
   causal convolution), the block reads them too and adds their input gradient. The input
   gradient plus g is ∂L/∂z_{k−1}, the next layer's g.
4. Scan chunks go from the last to the first: a chunk's μ starts from A^e ⊙ μ^e of the
   chunk after it (truncated: the chunk is rescanned T̄ − 1 tokens past its end).

The truncated gradient is the gradient of a model whose state h^t, seen from the
loss, is rebuilt from the stopped state h^{t−T̄} over the last T̄ steps (truncated
BPTT per layer); tests compare it with that model differentiated by autograd.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ...errors import LongtrainError
from ...memory.chunk_store import ChunkStore
from ...memory.units import parse_bytes
from ...models.adapters import DecoderAdapter, adapter_for
from ...models.layers import unwrap
from ...ops.chunked_loss import chunked_causal_lm_loss
from ...ops.linear_scan import adjoint_states
from ...ops.recurrence import Recurrence
from ...ops.replay import active_dropout
from ...parallel.layer_groups import LayerGroup
from ..batch import prepare_batch
from .options import AdjointOptions

__all__ = ["AdjointStats", "adjoint_step", "check_model", "truncated_adjoint_states"]


@dataclass
class AdjointStats:
    """What the last step did, per batch row and summed over layers."""

    adjoint_terms: int = 0  # (t, i) adjoint-state terms g^t λ^{t,i} summed (exact: T(T+1)/2 per layer)
    token_vjps: int = 0  # token-wise VJPs (one per token and layer, covering the A, B and C networks)
    vjp_calls: int = 0  # batched torch.func.vjp calls (blocks)
    block_tokens: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # scan chunks in the order the backward takes them


class LayerRecord(NamedTuple):
    """What the forward keeps of one layer: the paper's y_{k−1}, A, C, h, or with
    ``recompute`` y_{k−1} and the state entering each scan chunk (A, c, h are rebuilt
    from them, a chunk at a time, when the layer's turn comes)."""

    z_in: torch.Tensor | None  # (B, T, P) the layer's input: the residual stream below it (None while parked)
    a: torch.Tensor | None  # (B, T, *S) decays A^t (float32 under half precision, as h)
    c: tuple | None  # what the readout reads besides h (SSM-ResNet: c^t, C^t = W_o diag(c^t))
    h: torch.Tensor | None  # (B, T, *S) states h^t
    chunks: tuple = ()  # with recompute: (start, stop, h^{start−1} (B, *S) or None at 0) per scan chunk


def check_model(model) -> DecoderAdapter:
    """The model's adapter, if its layers are recurrences the engine can take apart
    (``adapter.recurrence``: SSM-ResNet, Mamba, Mamba-2); else one line."""
    adapter = adapter_for(model) if getattr(getattr(unwrap(model), "config", None), "model_type", None) else None
    if getattr(adapter, "recurrence", None) is None:
        raise LongtrainError(
            f"the adjoint engine trains state-space models (Mamba, Mamba-2, or an ssm-* preset such as ssm-demo), "
            f"not {type(unwrap(model)).__name__}; use --engine backprop, seco or spaco for transformers"
        )
    p = active_dropout(adapter.layers)
    if p > 0:
        raise LongtrainError(
            f"the adjoint engine recomputes each token's map in batched VJPs, which cannot draw the masks of a "
            f"dropout (p={p:g}, e.g. lora_dropout) as the forward drew them; set the dropout to 0, or use --engine backprop")
    return adapter


def _rows(x: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if x is None else x[:, start:stop]


@torch.no_grad()
def forward_layer(layer: Recurrence, z: torch.Tensor, mask: torch.Tensor | None, chunk: int | None) -> tuple[torch.Tensor, LayerRecord]:
    """The layer's output and what its backward needs: with ``chunk`` None every state
    kept, else the scan chunk by chunk, keeping the state that enters each chunk."""
    if chunk is None:
        z_out, a, c, h = layer.forward(z, mask)
        return z_out, LayerRecord(z, a, c, h)
    length, out, chunks, h0 = z.shape[1], None, [], None
    for start in range(0, length, chunk):
        stop, first = min(start + chunk, length), max(start - layer.window, 0)
        piece, _, _, h = layer.forward(z[:, first:stop], _rows(mask, first, stop), start - first, h0)
        if out is None:
            out = piece.new_empty(*z.shape[:2], *piece.shape[2:])
        out[:, start:stop] = piece
        chunks.append((start, stop, h0))
        h0 = h[:, -1].clone()  # not a view: the chunk's states go
    return out, LayerRecord(z, None, None, None, tuple(chunks))


def truncated_adjoint_states(a: torch.Tensor, direct: torch.Tensor, window: int,
                             keep: int | None = None) -> tuple[torch.Tensor, int]:
    """μ^i = Σ_{t=i}^{i+window−1} direct^t ⊙ A^{i+1} ⋯ A^t over dim 1 for the first ``keep``
    positions (default all; the rest only feed them), and the number of (t, i) terms summed
    for those (per batch row and state channel)."""
    length = a.shape[1]
    keep = length if keep is None else keep
    mu = direct.clone()
    run = None  # run[:, i] = A^{i+1} ⋯ A^{i+d}
    terms = keep
    for d in range(1, min(window, length)):
        run = a[:, d:] if run is None else run[:, : length - d] * a[:, d:]
        mu[:, : length - d] += direct[:, d:] * run
        terms += min(keep, length - d)
    return mu[:, :keep], terms


DEFAULT_VJP_MEMORY = 16 * 2**20


def _block_tokens(layer: Recurrence, rows: int, length: int, p: int, options: AdjointOptions, element_size: int) -> int:
    if options.block is not None:
        return min(options.block, length)
    per_token = layer.token_bytes(element_size) * rows
    if options.vjp_memory is None:
        budget = max(DEFAULT_VJP_MEMORY, rows * length * p * element_size)
    else:
        budget = parse_bytes(options.vjp_memory)
    return max(1, min(length, budget // per_token))


DEFAULT_CHUNK_MEMORY = 64 * 2**20


def scan_chunk(layer: Recurrence, rows: int, length: int, p: int, options: AdjointOptions, element_size: int) -> int | None:
    """Tokens per scan chunk (None: states kept whole). At least the layer's ``window``, so
    a chunk's maps read tokens of the chunk before it only. Sized by ``chunk_memory``, a
    chunk is a whole number of VJP blocks where it holds one (no block cut short at its
    end) and, truncated, at least T̄ tokens (each chunk rescans T̄ − 1 past its end)."""
    if not options.recompute:
        return None
    if options.chunk is not None:
        return max(min(options.chunk, length), layer.window, 1)
    # Per token: the decays, inputs and states with the scan's copies of them, and the
    # direct and adjoint states: about 6 state-sized arrays in the scan's dtype (≥ 4 bytes).
    per_token = 6 * layer.state_size() * max(element_size, 4) * rows
    if options.chunk_memory is None:
        budget = max(DEFAULT_CHUNK_MEMORY, rows * length * p * element_size)
    else:
        budget = parse_bytes(options.chunk_memory)
    chunk = max(budget // per_token, options.truncate or 0)
    if chunk >= length:
        return length
    block = _block_tokens(layer, rows, length, p, options, element_size)
    return max(chunk // block * block if chunk >= block else chunk, layer.window, 1)


def _direct_gradient(layer: Recurrence, c: tuple, h, grad_out, block: int, dtype) -> torch.Tensor:
    """C^{tT} g^t for every t: the gradient reaching h^t through the layer's own output
    y^t = C^t h^t, by VJPs of the readout (so adapters on it, LoRA, count) block by block."""
    direct = torch.empty(h.shape, dtype=dtype, device=h.device)
    for start in range(0, h.shape[1], block):
        sl = slice(start, start + block)
        _, vjp_fn = torch.func.vjp(lambda state: layer.readout(tuple(x[:, sl] for x in c), state), h[:, sl])
        direct[:, sl] = vjp_fn(grad_out[:, sl])[0]
    return direct


@torch.no_grad()  # the blocks' VJPs build their own small graphs; nothing else may
def backward_layer(
    layer: Recurrence,
    record: LayerRecord,
    grad_out: torch.Tensor,
    mask: torch.Tensor | None,
    options: AdjointOptions,
    stats: AdjointStats | None = None,
) -> torch.Tensor:
    """Accumulate the layer's parameter gradients and return ∂L/∂z_{k−1} given ∂L/∂z_k.

    Scan chunks go from the last to the first. Exact, the adjoint state entering a chunk
    from the one after it is A^{s} ⊙ μ^{s} of that chunk's first token s; truncated to
    T̄, a chunk's states run T̄ − 1 tokens past its end instead (their cotangents kept
    aside before the chunk after overwrote them)."""
    z, rows, length = record.z_in, record.z_in.shape[0], record.z_in.shape[1]
    block = _block_tokens(layer, rows, length, z.shape[-1], options, z.element_size())
    chunks = record.chunks or ((0, length, None),)
    ahead = 0 if options.truncate is None else options.truncate - 1
    terms = length * (length + 1) // 2 if options.truncate is None else 0
    carry = None  # exact: A^{s} ⊙ μ^{s} of the chunk after
    kept = grad_out[:, :0]  # truncated: the cotangents of the tokens after the chunk, before they were overwritten
    pending = None  # input gradient of the chunk after, reaching this chunk's last ``window`` tokens
    for start, stop, h0 in reversed(chunks):
        end = min(stop + ahead, length)
        if stats is not None:
            stats.chunk_tokens.append(stop - start)
        if record.a is None:
            first = max(start - layer.window, 0)
            _, a, c, h = layer.forward(z[:, first:end], _rows(mask, first, end), start - first, h0)
        else:
            a, c, h = record.a, record.c, record.h
        cotangents = torch.cat([grad_out[:, start:stop], kept[:, : end - stop]], 1) if end > stop else grad_out[:, start:stop]
        kept = cotangents[:, :ahead].clone() if ahead and start else kept
        direct = _direct_gradient(layer, c, h, cotangents, block, a.dtype)
        del c, cotangents
        if options.truncate is None:
            if carry is not None:
                direct[:, -1] += carry
            mu = adjoint_states(a, direct, overwrite=True)
            carry = a[:, 0] * mu[:, 0]
        else:
            mu, counted = truncated_adjoint_states(a, direct, options.truncate, stop - start)
            terms += counted
        del direct, a
        grad_in = _token_vjps(layer, z, mask, start, stop, h0, h, mu, grad_out, block, stats)
        del h, mu
        if pending is not None:
            grad_out[:, stop - pending.shape[1]: stop] += pending
        pending = grad_in
    if stats is not None:
        stats.adjoint_terms += terms
        stats.token_vjps += length
    return grad_out


def _shifted(h: torch.Tensor, h0: torch.Tensor | None) -> torch.Tensor:
    """h^{t−1} for the first tokens of a chunk: h0 (0 at the sequence's start), then h."""
    first = torch.zeros_like(h[:, :1]) if h0 is None else h0[:, None].to(h.dtype)
    return torch.cat([first, h[:, :-1]], 1)


def _token_vjps(layer: Recurrence, z, mask, start: int, stop: int, h0, h, mu, grad_out, block: int,
                stats: AdjointStats | None) -> torch.Tensor | None:
    """The token-wise VJPs of tokens start..stop (their states h and adjoint states mu from
    index 0, h0 the state before them, None for 0), block by block. ∂L/∂z_{k−1} is built in
    grad_out's storage: block [s, e) reads its cotangents grad_out[s:e] (no earlier block
    wrote there), then writes its input gradient over them and adds the part reaching the
    ``window`` tokens before s (their values are final). Returns the part reaching tokens
    before ``start`` (None at 0), which waits until the chunk before has read its cotangents."""
    before = None
    for s in range(start, stop, block):
        e = min(s + block, stop)
        first = max(s - layer.window, 0)  # the block's maps read tokens first..e
        h_prev = h[:, s - start - 1: e - start - 1] if s > start else _shifted(h[:, : e - start], h0)
        z_block = z[:, first:e].detach().requires_grad_()
        with torch.enable_grad():
            state, out = layer.local(z_block, _rows(mask, first, e), s - first, h_prev, h[:, s - start: e - start])
            # Through autograd's accumulation, so post-accumulate hooks, FSDP and LoRA see it.
            torch.autograd.backward([state, out], [mu[:, s - start: e - start].to(state.dtype), grad_out[:, s:e]])
        grad_z = z_block.grad
        grad_out[:, s:e] = grad_z[:, s - first:]
        inside = max(first, start)
        grad_out[:, inside:s] += grad_z[:, inside - first: s - first]
        if first < start:
            part = grad_z[:, : start - first]
            if before is None:
                before = torch.zeros_like(grad_z[:, : start - max(start - layer.window, 0)])
            before[:, before.shape[1] - part.shape[1]:] += part
        if stats is not None:
            stats.vjp_calls += 1
            stats.block_tokens.append(e - s)
    return before


class ParkedInputs:
    """The layers' kept inputs in pinned host memory (``offload_inputs``), within the run's
    host memory (past it, a step stops in one line before its backward). The top layer's
    input stays on the device (its backward comes first); each other one is fetched while
    the layer above it runs its backward."""

    def __init__(self, context, device: torch.device):
        self.store = ChunkStore(device, offload=True, host_budget=context.host_memory, pool=context.pool)

    def park(self, index: int, record: LayerRecord) -> LayerRecord:
        """``record`` without its input, which waits under ``index``."""
        try:
            self.store.put(index, record.z_in)
        except LongtrainError:  # past the host memory: what is parked goes back to the pool
            self.store.clear()
            raise
        return record._replace(z_in=None)

    def fetch(self, index: int, record: LayerRecord) -> LayerRecord:
        """``record`` with its input on the device; the next one below starts coming."""
        if record.z_in is None:
            record = record._replace(z_in=self.store.pop(index))
        if index - 1 in self.store:  # its layer's backward comes next
            self.store.prefetch(index - 1)
        return record


HEAD_TOKENS = 16384  # fewest tokens per mini-sequence of the final norm and head


def head_backward(adapter: DecoderAdapter, z_top: torch.Tensor, targets: torch.Tensor, num_label_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of the final norm + LM head and ∂L/∂z_K, in mini-sequences of at least
    ``HEAD_TOKENS`` tokens (at most 16): the norm is token-wise, and over the whole
    sequence its float32 temporaries would be several copies of the stream. The head's
    logits come in smaller mini-sequences still (the MsT op); the norm's and head's
    gradients are accumulated. z_top, the gradient: (B, T, P); targets (B, T), shifted."""
    head = adapter.head().module
    length = z_top.shape[1]
    size = max(HEAD_TOKENS, -(-length // 16))
    grad, loss = torch.empty_like(z_top), None
    for start in range(0, length, size):
        z = z_top[:, start:start + size].detach().requires_grad_()
        part = chunked_causal_lm_loss(adapter.final_norm(z), head.weight, targets[:, start:start + size], bias=head.bias,
                                      num_label_tokens=num_label_tokens, shifted=True)
        part.backward()
        grad[:, start:start + size] = z.grad
        loss = part.detach() if loss is None else loss + part.detach()
    return loss, grad


def embedding_backward(adapter: DecoderAdapter, input_ids: torch.Tensor, grad: torch.Tensor) -> None:
    embedding = adapter.embeddings()
    if embedding.weight.requires_grad:
        embedding(input_ids).backward(grad)


def adjoint_step(context, batch, num_label_tokens: int | None = None, stats: AdjointStats | None = None):
    """One micro-batch. On a model sharded by :func:`~longtrain.parallel.layer_groups.shard_model`
    this rank runs its layer group and exchanges the residual stream (forward) and its
    gradient (backward) with its neighbours; unsharded, one process runs every layer."""
    options: AdjointOptions = context.engine_options
    adapter = check_model(context.model)
    inputs = prepare_batch(batch, num_label_tokens)
    if inputs.mask.segments is not None:
        raise LongtrainError(f"{adapter.config.model_type} does not reset its state at document boundaries; "
                             "pass batches without position resets (no packed documents) to the adjoint engine")
    num_label_tokens = inputs.num_label_tokens
    layers = [adapter.recurrence(layer) for layer in adapter.layers]
    group = context.parallel if isinstance(context.parallel, LayerGroup) else LayerGroup(len(layers), 0, 1)
    mask = inputs.mask.key_valid
    tied = (adapter.embeddings().weight if group.first else adapter.head().module.weight) if group.tied else None
    previous = None
    if tied is not None:  # this step's part of a tied embedding's gradient alone; summed with the other copy's below
        previous, tied.grad = tied.grad, None
    if group.first:
        with torch.no_grad():
            z = adapter.embed(inputs.input_ids)
    else:
        z = group.recv(_stream_like(adapter, layers[group.layers[0]], inputs.input_ids), up=False)
    parked = ParkedInputs(context, z.device) if options.offload_inputs else None
    records = []
    for index in group.layers:
        chunk = scan_chunk(layers[index], *z.shape[:2], z.shape[-1], options, z.element_size())
        z, record = forward_layer(layers[index], z, mask, chunk)
        records.append(record if parked is None or index == group.layers[-1] else parked.park(index, record))
    if group.last:
        loss, grad = head_backward(adapter, z, inputs.targets, num_label_tokens)
    else:
        group.send(z, up=True)
        grad = group.recv(z, up=True)
    del z
    for index in reversed(group.layers):
        record = records.pop() if parked is None else parked.fetch(index, records.pop())
        grad = backward_layer(layers[index], record, grad, mask, options, stats)
    if group.first:
        embedding_backward(adapter, inputs.input_ids, grad)
    else:
        group.send(grad, up=False)
    if tied is not None:
        group.sum_tied(tied, previous)
    if group.world_size > 1:  # every rank reports the loss the last rank computed
        value = loss.double() if group.last else torch.zeros((), dtype=torch.float64, device=grad.device)
        torch.distributed.broadcast(value, group.world_size - 1, group=group.process_group)
        loss = loss if group.last else value.to(torch.float64 if grad.dtype == torch.float64 else torch.float32)
    return loss


def _stream_like(adapter: DecoderAdapter, layer: Recurrence, input_ids: torch.Tensor) -> torch.Tensor:
    """An empty residual-stream tensor (B, T, hidden) as it enters ``layer``, whose rank receives it."""
    weight = next(layer.layer.parameters())
    return torch.empty(*input_ids.shape, adapter.description.hidden, dtype=layer.stream_dtype(), device=weight.device)
