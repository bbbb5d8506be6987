"""Which model families longtrain trains exactly, checked on the installed transformers.

For each causal-LM family transformers knows, :func:`check_family` builds a tiny model
from its config (two layers, random weights, float64; a mixture of experts with its
load-balancing loss on), and compares one step of every engine and technique with stock
autograd on the same model — loss and every gradient, relative error at most 1e-10 — on
right-padded, left-padded and packed batches whose lengths divide no chunk, a row whose
last chunk is one MLP tile and a one-tile row; then, with every dropout on, it checks each
strategy's gradient against the derivative of the loss it reports (:mod:`.dropout`). A
family is *exact* when every comparison passes, *refused* when longtrain refuses it (one
line, the reason), and *inexact* otherwise. Families without an adapter are tried with
the Llama-layout adapter, which tells whether registering the family's name would be enough.

``longtrain families`` runs each family in a child process of bounded memory
(:mod:`.child`) and writes the table and its JSON (:mod:`.table`).
"""

from __future__ import annotations

from .cases import (
                    BATCHES,
                    DROPOUT,
                    FD_TOLERANCE,
                    ROUTER_AUX_LOSS_COEF,
                    STRATEGIES,
                    TOLERANCE,
                    causal_families,
                    tiny_config,
)
from .check import check_family
from .child import MEMORY_LIMIT, check_in_process
from .dropout import directional_error, dropout_errors
from .float64 import float64_throughout
from .result import FamilyResult
from .table import merged, write_table

__all__ = ["BATCHES", "DROPOUT", "FD_TOLERANCE", "MEMORY_LIMIT", "ROUTER_AUX_LOSS_COEF", "STRATEGIES", "TOLERANCE",
           "FamilyResult", "causal_families", "check_family", "check_in_process", "directional_error", "dropout_errors",
           "float64_throughout", "merged", "tiny_config", "write_table"]
