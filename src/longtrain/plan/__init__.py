"""Planning floor, above the strategy, models and optimizers it runs: full-scale simulation
of a strategy on fake tensors (:mod:`.simulate`, extended from small sizes by
:mod:`.extrapolate`), the time model (:mod:`.time_model`, :mod:`.calibrate`), and the
planner that ranks strategies for a machine (:mod:`.planner`, :mod:`.longest`,
:mod:`.auto`)."""

__all__: list[str] = []
