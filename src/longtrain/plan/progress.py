"""Where ``longtrain simulate`` reports a simulation's phases (:class:`SimulationProgress`)."""

from __future__ import annotations

import sys

__all__ = ["SimulationProgress"]


class SimulationProgress:
    """Where a simulation reports its phases: on a terminal, one live line on stderr (tqdm,
    its clock ticking); otherwise one line per phase on stderr; nothing when disabled."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.bar, self._stop = enabled, None, None

    def __enter__(self):
        if self.enabled and sys.stderr.isatty():
            import threading

            from tqdm import tqdm

            self.bar = tqdm(total=None, file=sys.stderr, bar_format="simulate: {desc} [{elapsed}]", dynamic_ncols=True,
                            leave=False)
            self._stop = threading.Event()
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self.bar.refresh()

    def __call__(self, line: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(line)
        elif self.enabled:
            print(f"longtrain simulate: {line}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self._stop.set()
            self.bar.close()
        return False
