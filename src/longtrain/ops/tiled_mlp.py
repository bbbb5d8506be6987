"""Mini-sequence (tiled) MLP: only one chunk's intermediates are alive, forward and backward.

An MLP acts on each token independently, so its output can be computed chunk by chunk
of tokens. :func:`tiled_mlp` saves only the MLP's input; its backward recomputes one
chunk at a time with autograd and returns the weight gradients summed over chunks, so
autograd accumulates them exactly once into ``.grad`` — LoRA adapters, gradient
accumulation and sharded parameters work as with the plain module, and no
post-accumulate-grad hook fires once per chunk. Work: one forward, then in backward one
recomputed forward and the backward proper (2×) — three forwards' FLOPs in all, the
least any recomputing MLP can do.

Two autograd nodes share the work so that activation checkpointing around the layer
does not add a third forward. The first (``_TiledMLPGrad``) saves the input and
computes nothing; the second (``_TiledMLPOutput``) computes the output and saves
nothing; the output's gradient reaches the first through a mailbox. A checkpointed
layer's recomputation stops as soon as it has re-saved the last tensor the layer saved
(``torch.utils.checkpoint``'s early stop): when nothing after the MLP saves a tensor —
the MLP output only joins the residual stream, as in Llama, Qwen, Mistral, Phi-3 — that
is the input saved by the first node, so the MLP's forward is not rerun there, and its
only recomputation is the one its own backward needs. Where a later op saves the MLP's
output (Gemma-2's post-feed-forward norm) the recomputation must produce it: three
forwards, as before.

An engine that recomputes a single layer only to backpropagate through it (FPDT) never
reads the layer's output, and so never the MLP's: under :func:`outputs_unread` the
output node computes nothing and returns a NaN-filled placeholder of the output's shape
and dtype (NaN, so that a reader shows at once), and the MLP's only forward there is the
one its own backward needs. The placeholder has x's shape (a feed-forward block maps
back to the residual width) and the dtype of its last linear (autocast's where autocast
casts x, else x's); a mismatch would stop autograd with an error, not bend a gradient.
Only valid where no later op of the layer saves the MLP output or anything computed
from it (a norm after the MLP, as in Gemma-2 and OLMo-2, does: :mod:`.unread_outputs`
learns it per layer from the autograd graph), and where the MLP draws no random
numbers (a later dropout would draw from another state): with dropout in the MLP the
output is computed. :func:`watched_outputs` collects the autograd nodes of the outputs
computed in a block, for that learning.

Random numbers (dropout in the MLP, LoRA's ``lora_dropout``): the tiles draw in order
from the generator states the forward started them from, and the backward sets those
states again before recomputing them, so each tile draws the masks its forward drew
(:mod:`.replay`). A forward without autograd (a chunked engine's first pass) tiles too,
so that its draws are the ones the recomputation makes. A recomputation of a subset of
the forward's tokens (Memo's) keeps the forward's tiles: it runs each tile's rows of the
subset as a scope of its own, in which the tile's draws are replayed and sliced.

Given the ``module`` that ``fn`` runs, the backward forms the weight gradients of its plain
linear layers itself (:class:`_LinearCalls`): per tile one GEMM adding into the float32
sum, instead of a new bf16 weight-sized gradient per tile from autograd that the loop then
adds (memory traffic outside the GEMMs: expected ~6% of a GPU's MLP backward at
Llama-3-8B's 4,096-token tiles, not yet measured). Exact: only where the recorded calls are all that
reads those weights in the tile; otherwise autograd forms that tile's gradients as before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..thread_flag import ThreadFlag
from . import _autocast, replay, token_rows
from .gemm import add_product
from .tiles import tile_starts

__all__ = ["outputs_unread", "tiled_mlp"]


_unread = ThreadFlag()  # raised by outputs_unread() on the thread running the forward
_watch = threading.local()  # .nodes: where watched_outputs() collects computed outputs' autograd nodes


def outputs_unread():
    """Tiled MLPs run forward in this block will only be backpropagated through, their
    output values never read (module docstring)."""
    return _unread.raised()


@contextlib.contextmanager
def watched_outputs():
    """Yields a list that collects the autograd node of every tiled MLP output computed
    (not a placeholder) in the block, on this thread."""
    before, _watch.nodes = getattr(_watch, "nodes", None), []
    try:
        yield _watch.nodes
    finally:
        _watch.nodes = before


class _Mailbox:
    """What the two nodes of one call share: the output's gradient, which
    ``_TiledMLPOutput.backward`` (run first by autograd: its input is the other node's
    output) leaves for ``_TiledMLPGrad.backward``; the generator states the forward's
    tiles started from; the tiles' scopes in a recording or replay of seeded ops."""

    __slots__ = ("grad", "states", "scopes")

    def __init__(self, states, scopes):
        self.grad, self.states, self.scopes = None, states, scopes


class _TiledMLPGrad(torch.autograd.Function):
    """Saves the MLP's input; its backward recomputes and backpropagates chunk by chunk.
    Its output is a 0-d token that links it to ``_TiledMLPOutput``."""

    @staticmethod
    def forward(ctx, fn, chunk_tokens, mailbox, module, x, *params):
        ctx.fn, ctx.chunk_tokens, ctx.mailbox, ctx.module, ctx.params = fn, chunk_tokens, mailbox, module, params
        ctx.autocast = _autocast.capture(x.device)
        ctx.rows = token_rows.capture()  # which rows are real tokens, for ops that count them
        ctx.save_for_backward(x)  # the only tensor kept for backward
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        (x,) = ctx.saved_tensors
        grad_out, ctx.mailbox.grad = ctx.mailbox.grad, None
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        want_x = ctx.needs_input_grad[4]
        wanted = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[5:]) if needed]
        grad_x = torch.empty_like(flat) if want_x else None
        sums = _GradientSums()
        # Without autocast (which casts inside each linear), the plain linears' weight
        # gradients are formed here, one GEMM per tile into the sum (:mod:`.gemm`).
        with _LinearCalls(ctx.module if not ctx.autocast[1] else None, wanted) as linears, \
                replay.restoring(ctx.mailbox.states), token_rows.restore(ctx.rows):  # each tile draws what its forward drew
            for start in tile_starts(flat.shape[0], ctx.chunk_tokens, flat):
                rows = slice(start, start + ctx.chunk_tokens)
                with token_rows.tile(start):
                    grad_piece = _tile_backward(ctx, flat[rows], grad_flat[rows], want_x, wanted, linears, sums)
                if want_x:
                    grad_x[rows] = grad_piece
                del grad_piece  # (each tile's intermediates are freed before the next recomputes its own)
        param_grads = iter(sums.rounded(p) for p in wanted)
        return (None, None, None, None, grad_x.view_as(x) if want_x else None,
                *(next(param_grads) if needed else None for needed in ctx.needs_input_grad[5:]))


def _tile_backward(ctx, rows, grad_rows, want_x, wanted, linears, sums):
    """Recompute one tile and backpropagate it: its weight gradients go into ``sums``; its
    input's gradient is returned (None when not wanted). A function of its own so that the
    tile's intermediates die with it."""
    piece = rows.detach().requires_grad_(want_x)
    with torch.enable_grad(), _autocast.restore(ctx.autocast):
        y = ctx.fn(piece)
    calls = linears.take(y)
    by_autograd = [p for p in wanted if not calls or id(p) not in linears.covered]
    inputs = ([piece] if want_x else []) + by_autograd + [call[2] for call in calls]
    grads = list(torch.autograd.grad(y, inputs, grad_rows, allow_unused=True))
    grad_piece = grads.pop(0) if want_x else None
    for param, grad in zip(by_autograd, grads):
        sums.add(param, grad)
    for (linear, inp, _), grad in zip(calls, grads[len(by_autograd):]):
        sums.add_linear(linear, inp, grad, wanted_bias=id(linear.bias) in linears.covered)
    return grad_piece


class _LinearCalls:
    """The calls of the plain ``nn.Linear`` layers of ``module`` whose weights are among
    ``wanted``, recorded during one tile's recomputation (a forward hook on each, removed on
    exit): ``(linear, input, output)``. The backward asks autograd for the outputs' gradients
    instead of the weights', and forms the weights' itself — one GEMM adding into the
    float32 sum (:func:`~longtrain.ops.gemm.add_product`) where autograd would form a new
    bf16 gradient per tile, which the loop then adds. LoRA adapters' ``lora_A``/``lora_B``
    are such linears; a frozen base weight is not hooked.

    Only where the recorded calls are provably the whole story: a linear with a forward of
    its own (patched on the instance), hooks of its own or global module hooks (which may
    replace what it returns), subclasses (quantized layers) are left to autograd; and per
    tile, if an input or output was changed in place after the call, or a covered parameter
    is used in the tile other than by the recorded calls (PEFT variants that read
    ``lora_A.weight`` directly), autograd forms every gradient of that tile."""

    def __init__(self, module: nn.Module | None, wanted):
        ids = {id(p) for p in wanted}
        self.linears = [] if module is None or _global_module_hooks() else [
            m for m in module.modules() if type(m) is nn.Linear and id(m.weight) in ids and _unadorned(m)]
        self.covered = {id(t) for m in self.linears for t in (m.weight, m.bias) if t is not None and id(t) in ids}
        self._calls, self._hooks, self._complete = [], [], True

    def __enter__(self):
        self._hooks = [m.register_forward_hook(self._record, with_kwargs=True) for m in self.linears]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _record(self, module, args, kwargs, output):
        inp = args[0] if args else kwargs.get("input")
        if not isinstance(inp, torch.Tensor) or len(args) + len(kwargs) != 1:
            self._complete = False
            return
        self._calls.append((module, inp, output, inp._version, output._version))

    def take(self, y: torch.Tensor) -> list[tuple]:
        """This tile's calls, ``y`` being the tile's output; none (autograd forms every
        gradient of the tile) where the calls may not account for every gradient: see the
        class docstring."""
        calls, complete, self._calls, self._complete = self._calls, self._complete, [], True
        if not calls or not complete or any(inp._version != v_in or out._version != v_out or not out.requires_grad
                                            for _, inp, out, v_in, v_out in calls):
            return []
        expected: dict[int, int] = {}
        for m, *_ in calls:
            for t in (m.weight, m.bias):
                if t is not None and id(t) in self.covered:
                    expected[id(t)] = expected.get(id(t), 0) + 1
        if _parameter_uses(y, self.covered) != expected:
            return []
        return [(m, inp, out) for m, inp, out, _, _ in calls]


def _unadorned(linear: nn.Linear) -> bool:
    """No forward of its own, no hooks: its call is ``F.linear(input, weight, bias)``."""
    return "forward" not in linear.__dict__ and not any(
        (linear._forward_hooks, linear._forward_pre_hooks, linear._backward_hooks, linear._backward_pre_hooks))


def _global_module_hooks() -> bool:
    from torch.nn.modules import module as m

    return any((m._global_forward_hooks, m._global_forward_pre_hooks, m._global_backward_hooks,
                m._global_backward_pre_hooks))


def _parameter_uses(y: torch.Tensor, covered: set[int]) -> dict[int, int]:
    """How many edges of ``y``'s autograd graph (one tile's) reach each covered parameter's
    gradient accumulator: one per linear call that reads it, more where something else does."""
    uses: dict[int, int] = {}
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:
                if id(variable) in covered:
                    uses[id(variable)] = uses.get(id(variable), 0) + 1
            else:
                stack.append(child)
    return uses


class _GradientSums:
    """The weight gradients of the tiles, summed: float32 for half-precision weights (see
    :func:`_sum_dtype`), keyed by the parameter."""

    def __init__(self):
        self._sums: dict[int, torch.Tensor] = {}

    def add(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        total = self._sums.get(id(param))
        self._sums[id(param)] = _widened(grad) if total is None else total.add_(grad)

    def _buffer(self, param: torch.Tensor) -> torch.Tensor:
        total = self._sums.get(id(param))
        if total is None:
            total = self._sums[id(param)] = torch.zeros(param.shape, dtype=_sum_dtype(param.dtype), device=param.device)
        return total

    def add_linear(self, linear: nn.Linear, inp: torch.Tensor, grad: torch.Tensor | None, wanted_bias: bool) -> None:
        """One call's weight (and bias) gradient, ``grad`` being its output's."""
        if grad is None:
            return
        grad = grad.reshape(-1, grad.shape[-1])
        add_product(self._buffer(linear.weight), grad.t(), inp.reshape(-1, inp.shape[-1]))
        if wanted_bias:
            bias = self._buffer(linear.bias)
            bias += grad.sum(0, dtype=bias.dtype)

    def rounded(self, param: torch.Tensor) -> torch.Tensor | None:
        return _rounded(self._sums.get(id(param)), param)


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """A weight gradient's sum over tiles is float32 for a half-precision weight. Summed in
    bf16, each tile's add rounds the running sum to 8 bits, and the error grows with the
    tile count (64 tiles: twice a stock bf16 backward's, 256: four times — tests/test_mst.py);
    in float32 the sum is rounded once, as stock's single GEMM is."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _widened(grad: torch.Tensor) -> torch.Tensor:
    """The first tile's weight gradient as the sum's buffer (:func:`_sum_dtype`)."""
    return grad.to(_sum_dtype(grad.dtype))


def _rounded(total: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    return None if total is None else total.to(param.dtype)


class _TiledMLPOutput(torch.autograd.Function):
    """The MLP's output, computed chunk by chunk without autograd; saves nothing. Its
    backward posts the output's gradient to the mailbox."""

    @staticmethod
    def forward(ctx, fn, tiles, mailbox, x, token, unread=False):
        ctx.mailbox = mailbox
        if unread:  # a feed-forward block ends in a linear back to the width of x
            _, autocast, dtype = _autocast.capture(x.device)
            cast = autocast and x.dtype != torch.float64  # autocast leaves float64 alone
            return torch.full_like(x, float("nan"), dtype=dtype if cast else x.dtype)
        return _run_tiles(fn, x, tiles, mailbox.scopes)

    @staticmethod
    def backward(ctx, grad_out):
        ctx.mailbox.grad = grad_out
        return None, None, None, None, torch.zeros((), dtype=grad_out.dtype, device=grad_out.device), None


def _run_tiles(fn, x: torch.Tensor, tiles, scopes: replay.TileScopes) -> torch.Tensor:
    """``fn`` over ``x``'s flattened tokens tile by tile: ``tiles`` are ``(start, stop, key,
    positions)``, each tile in its scope (``key``, and for a subset's replay the rows of
    the forward's tile it holds)."""
    flat = x.reshape(-1, x.shape[-1])
    out = None
    for start, stop, key, positions in tiles:
        with scopes.scope(key, positions), token_rows.tile(start):
            y = fn(flat[start:stop])
        if out is None:
            out = y.new_empty((flat.shape[0], y.shape[-1]))
        out[start:stop] = y
    return out.view(*x.shape[:-1], out.shape[-1])


def _tiles(n_tokens: int, chunk_tokens: int, reference: torch.Tensor) -> list[tuple]:
    return [(start, min(start + chunk_tokens, n_tokens), key, None)
            for key, start in enumerate(tile_starts(n_tokens, chunk_tokens, reference))]


def _subset_tiles(rows: replay.ReplayedRows, chunk_tokens: int) -> list[tuple]:
    """The tiles of a replay of some of the forward's rows: for each tile of the forward
    that holds some of them, their span here and their places in that tile."""
    positions, tiles = rows.positions(rows.device), []
    for key, start in enumerate(range(0, rows.forward_count, chunk_tokens)):
        lo, hi = rows.before(start), rows.before(start + chunk_tokens)
        if lo < hi:
            tiles.append((lo, hi, key, positions[lo:hi] - start))
    return tiles


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
              chunk_tokens: int, module: nn.Module | None = None) -> torch.Tensor:
    """Apply the token-wise function ``fn`` to ``x`` (..., d) in chunks of ``chunk_tokens`` tokens.

    ``params`` are the tensors ``fn`` uses that may need gradients (e.g. the MLP's
    trainable parameters); their gradients are returned to autograd summed over chunks.
    ``module``: the module ``fn`` runs, when there is one; the weight gradients of its plain
    linear layers are then one GEMM per chunk into their sum (:class:`_LinearCalls`).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    n_tokens = x.numel() // x.shape[-1]
    subset = replay.replayed_rows(n_tokens)  # a recomputation of some of a forward's tokens: tile as it did
    if (subset.forward_count if subset else n_tokens) <= chunk_tokens:
        return fn(x)  # one chunk: nothing to save by tiling
    tiles = _tiles(n_tokens, chunk_tokens, x) if subset is None or is_fake(x) else _subset_tiles(subset, chunk_tokens)
    scopes = replay.tile_scopes()
    if not torch.is_grad_enabled():  # no backward: the tiles alone, drawing as a recomputation will
        return _run_tiles(fn, x, tiles, scopes)
    mailbox = _Mailbox(replay.capture(x), scopes)
    # saves x first: see the module docstring
    token = _TiledMLPGrad.apply(fn, chunk_tokens, mailbox, module, x, *params)
    # An MLP that draws random numbers runs even where its output goes unread: what a later
    # op of the layer draws must start where the forward's did.
    unread = _unread.on and not (module is not None and replay.active_dropout(module) > 0)
    out = _TiledMLPOutput.apply(fn, tiles, mailbox, x.detach(), token, unread)
    watching = getattr(_watch, "nodes", None)
    if watching is not None and not unread:
        watching.append(out.grad_fn)
    return out
