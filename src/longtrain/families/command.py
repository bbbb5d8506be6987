"""``longtrain families``: check the named families (or all), one bounded child process at a
time, and write the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import LongtrainError
from .cases import causal_families
from .child import _check_in_child, _gib
from .table import merged, write_table

__all__ = ["run"]


def run(args) -> int:
    """The command (its arguments parsed by ``longtrain.cli``); progress on stderr, one line per family."""
    import transformers

    from ..memory.units import format_bytes

    if args.timeout <= 0:
        raise LongtrainError(f"--timeout must be positive, got {args.timeout:g}")
    if args.update and not args.families:
        raise LongtrainError("--update re-checks the families named; name them (or drop --update to check all)")
    known = causal_families()
    unknown = [f for f in args.families if f not in known]
    if unknown:
        raise LongtrainError(f"not a decoder-only causal-LM family of transformers {transformers.__version__}: "
                             f"{', '.join(unknown)}; omit the names to check every family")
    results = []
    names = args.families or known
    for i, family in enumerate(names, 1):  # one at a time: each check's memory is bounded, so is the machine's
        result, peak = _check_in_child(family, args.timeout, args.memory_limit)
        said = f"{result.status}: {result.reason}" if result.status == "not built" and result.reason else result.status
        print(f"[{i}/{len(names)}] {family}: {said} ({result.seconds:.1f} s, peak {format_bytes(peak)} resident)",
              file=sys.stderr, flush=True)
        results.append(result)
    out = Path(args.out)
    command = " ".join(["longtrain families", *args.families] + ([] if args.out == "families.md" else ["--out", args.out])
                       + ([] if args.timeout == 120.0 else ["--timeout", f"{args.timeout:g}"])
                       + ([] if args.memory_limit == 4 * 2**30 else ["--memory-limit", _gib(args.memory_limit).replace(" ", "")]))
    if args.update:
        results = merged(results, out.with_suffix(".json"))
        earlier = json.loads(out.with_suffix(".json").read_text())["command"] if out.with_suffix(".json").is_file() else ""
        command = f"{earlier}; {command} --update" if earlier else f"{command} --update"
    write_table(results, out, transformers.__version__, command)
    exact = [r.family for r in results if r.adapter and r.status == "exact"]
    print(f"{len(exact)} supported families exact; table in {args.out}")
    return 0
