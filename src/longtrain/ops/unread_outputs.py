"""When a recomputed layer's tiled MLP may skip its output, learned from the layer itself.

An engine that recomputes a layer only to backpropagate through it never reads the
layer's output; the tiled MLP can then hand back a placeholder instead of computing its
output (:func:`~longtrain.ops.tiled_mlp.outputs_unread`) — but only where no op after
the MLP saves a tensor for its backward. A norm after the MLP (Gemma-2, OLMo-2, GLM-4,
EXAONE-4) saves its input, which would be the placeholder: NaN gradients. Which layers
are safe is a fact of the model's code, not of its family's name, so it is learned:
the first recomputation of each layer computes the MLP output and walks the autograd
graph from the layer's output back to the MLP's; if no node on those paths saved a
tensor, later recomputations of that layer skip the output. A layer whose MLP ran in one
tile (no tiled output to find) is learned at a later recomputation.

A node's saved tensors are its ``_saved_*`` attributes (C++ nodes), or its
``saved_tensors`` and tensor attributes, in lists and tuples too (custom Functions); a one-element saved tensor (a scalar operand)
cannot carry the MLP's output, any other counts, even where it is independent of it (a
dropout's mask): the MLP output is then computed, which is exact either way.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from .tiled_mlp import outputs_unread, watched_outputs

__all__ = ["UnreadMLPOutputs", "saved_between"]


class UnreadMLPOutputs:
    """Per layer, whether its recomputation may leave the tiled MLP's output unread
    (learned at its first recomputation; see the module)."""

    def __init__(self):
        self._safe: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def recomputing(self, layer: nn.Module):
        """Around one recomputation of ``layer`` whose output is only backpropagated
        through; yields ``learn(output)``, to call with the layer's output."""
        known = self._safe.get(layer)
        if known is not None:
            with outputs_unread() if known else contextlib.nullcontext():
                yield _ignore
            return
        with watched_outputs() as nodes:
            yield lambda out: self._learn(layer, out, nodes)

    def learned(self, layer: nn.Module) -> bool | None:
        """Whether ``layer``'s recomputations skip its MLP output (None: not learned yet)."""
        return self._safe.get(layer)

    def _learn(self, layer: nn.Module, out: torch.Tensor, nodes: list) -> None:
        if nodes and out.grad_fn is not None:
            self._safe[layer] = not saved_between(out.grad_fn, set(nodes))


def _ignore(out: torch.Tensor) -> None:
    return None


def saved_between(top, ends: set) -> bool:
    """Whether a node on a path from ``top`` down to one of ``ends`` (autograd nodes),
    ``ends`` excluded, saved a tensor of more than one element for its backward."""
    reaches: dict = {}
    stack = [(top, False)]
    while stack:
        node, children_done = stack.pop()
        if node in reaches:
            continue
        if node in ends:
            reaches[node] = True
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in reaches)
            continue
        reaches[node] = any(reaches.get(child, False) for child in children)
    return any(hit and node not in ends and _saves_tensors(node) for node, hit in reaches.items())


def _saves_tensors(node) -> bool:
    if hasattr(node, "_raw_saved_tensors"):  # a custom Function's context: saved, or kept as attributes
        kept = [*node.saved_tensors, *vars(node).values()]
    else:
        kept = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
    saved = [t for value in kept for t in (value if isinstance(value, (list, tuple)) else [value])]
    return any(isinstance(t, torch.Tensor) and t.numel() > 1 for t in saved)
