"""Training: data, the built-in long-range task, checkpoints, logging and the Trainer."""
