"""Model adapters, presets and loading."""
