"""Planning floor: full-scale simulation of a strategy (and, later, the planner that
ranks strategies). It sits above the strategy, models and optimizers it runs."""
