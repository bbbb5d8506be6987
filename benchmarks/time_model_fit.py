"""The time model's rate tables refitted to every GPU row measured so far, with the error
each row gets in the fit and out of it.

Rows: every step time stored in docs/results/gpu_peers.json (one H100 80 GB, 2026-11-23),
gpu_peers_h200.json and gpu_peers_h200_experts.json (one H200, 2026-11-26 and -30), and
SeCO's H100 rows of 2026-11-22 (docs/seco.md); planned_step.json's whole step (optimizer
included) is listed, left out. Each case is the strategy it ran (a peer as
the longtrain strategy doing the same work: Hugging Face's checkpointing reruns attention,
Liger's fused loss is a chunked head, selective checkpointing keeps attention's outputs on
the device); rows whose work the model does not describe are listed with the reason and
left out of the fit (synchronous ``save_on_cpu`` offload; code since changed).

The fit: per card, the rates the measured steps depend on (matmul, attention kernels, the
tiled MLP's efficiency, the head's weight gradient, the chunked engines' per-(chunk, layer)
cost, the exposed share of host copies, the elementwise bandwidth) minimise the squared log
ratio of predicted to measured time, with a weak pull toward the prior (the H100 rates before
this fit; for the H200, the H100 fit with its elementwise bandwidth scaled by the cards' HBM
bandwidths, 4.8/3.35) so a rate no row depends on stays where it was. Out of sample: each
row predicted by a fit without it (leave one out), and each H200 row by the H100 table.
Ranking: within one run and length, every pair of cases whose measured times differ by more
than ``NOISE`` (the run-to-run spread of the same case on the H200) predicted in that order.

    python benchmarks/time_model_fit.py          # writes docs/results/time_model_fit.{json,md}
    python benchmarks/time_model_fit.py --smoke  # two rows per card, no leave-one-out: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import longtrain as lt
from longtrain.models.adapters import describe_model
from longtrain.models.presets import preset_config
from longtrain.plan.time_model import H100, H200, MachineRates, step_time

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
K = 1024
HOST = 96 * 10**9  # three quarters of the GPU machines' 128 GB: the offloading cases' host budget
NOISE = 0.035  # the same case's step in two runs on the H200: 2-3% apart (32K and 64K rows)
FITTED = ("matmul", "fused_attention", "block_attention", "chunkwise_attention", "tiled_mlp_efficiency",
          "head_weight_grad", "per_chunk_layer", "offload_exposed", "elementwise")
PRIOR_WEIGHT = 0.2  # a rate 10% from its prior costs what a row 2% off costs
# The H100 rates before this fit (2026-11-23: no elementwise term; its bandwidth an estimate).
PRIOR_H100 = MachineRates(matmul=6.5e14, fused_attention=4.6e14, block_attention=4.3e14, chunkwise_attention=1.9e14,
                          tiled_mlp_efficiency=0.68, head_weight_grad=5.0e14, per_chunk_layer=6.8e-3,
                          offload_exposed=0.068, elementwise=2.3e12, host_bandwidth=2.5e10)
HBM = {"H100": 3.35e12, "H200": 4.8e12}  # datasheet bytes/s
LLAMA = preset_config("llama3-8b")  # the model of every stored row


@dataclass
class Row:
    card: str  # "H100" or "H200"
    source: str  # the results file (or doc) it is stored in, and its run
    case: str
    tokens: int
    measured: float  # median seconds per step
    strategy: lt.Strategy | None
    notes: dict = field(default_factory=dict)  # what the time model reads of the run (Memo's α)
    extra_flops: float = 0.0  # matmul FLOPs the code of that date ran beyond today's (see corrections)
    left_out: str | None = None  # why the model does not describe the row

    def predict(self, rates: MachineRates) -> float:
        return step_time(LLAMA, self.tokens, self.strategy, rates, notes=self.notes).seconds + self.extra_flops / rates.matmul


def _fpdt(tokens: int, **options) -> dict:
    chunk = max(1, min(16384 if tokens > 32768 else 8192, tokens // 4))
    if options.get("offload") or options.get("offload_inputs"):
        options.setdefault("host_memory", HOST)
    return {"chunk": chunk, **options}


def _strategy(case: str, tokens: int, notes: str | None) -> tuple[lt.Strategy | None, dict, str | None]:
    """The strategy a stored case ran, what the model reads of its notes, or why it has none."""
    plain = {
        "hf+liger": "checkpoint:keep_attention=false,mst:mlp=false,liger",
        "hf+liger+sac": "checkpoint:offload=false,mst:mlp=false,liger",
        "lt:recompute+mst": "checkpoint:keep_attention=false,mst",
        "lt:checkpoint+mst": "checkpoint,mst",
        "lt:checkpoint+mst+liger": "checkpoint,mst,liger",
        "lt:checkpoint+ondevice+mst+liger": "checkpoint:offload=false,mst,liger",
    }
    if case in plain:
        return lt.Strategy.parse(plain[case]), {}, None
    if case in ("hf+offload", "hf+liger+offload"):
        return None, {}, "save_on_cpu's synchronous copies: not a strategy the model describes"
    if case == "lt:auto":
        return lt.Strategy.parse(re.search(r"auto chose (\S+)", notes).group(1)), {}, None
    if case == "lt:memo+mst":
        alpha = float(re.search(r"alpha ([\d.]+)", notes).group(1))
        return lt.Strategy(memo={"alpha": alpha}, mst=True), {"memo_alpha": alpha}, None
    fpdt = re.fullmatch(r"lt:fpdt(\+offload)?(\+inputs)?(\+keep)?\+mst(\+liger)?", case)
    if fpdt:
        offload, inputs, keep, liger = (bool(g) for g in fpdt.groups())
        options = _fpdt(tokens, **({"offload": True} if offload else {}), **({"offload_inputs": True} if inputs else {}),
                        **({"keep_output": True} if keep else {}))
        return lt.Strategy(engine="fpdt", engine_options=options, mst=True, **({"liger": True} if liger else {})), {}, None
    return None, {}, f"case {case} not described"


def _stored_rows() -> list[Row]:
    rows = []
    config = LLAMA
    shape = describe_model(config)
    for name, card in (("gpu_peers", "H100"), ("gpu_peers_h200", "H200"), ("gpu_peers_h200_experts", "H200")):
        data = json.loads((RESULTS / f"{name}.json").read_text())
        for stored in data["rows"]:
            if not stored.get("step_s"):
                continue
            tokens, case = stored["tokens"], stored["case"]
            strategy, notes, left_out = _strategy(case, tokens, stored.get("notes"))
            run = f"{name}.json" + (f" run {stored['run']}" if stored.get("run") else "")
            row = Row(card, run, case, tokens, stored["step_s"], strategy, notes, left_out=left_out)
            if card == "H100" and case.startswith("lt:"):
                _corrected_for_2026_11_23(row, config, shape)
            if case == "lt:memo+mst" and card == "H100":
                row.left_out = "Memo's code of 2026-11-23 (its copies did not hide; fixed since: the H200 row)"
            rows.append(row)
    for tokens, spec, engine, seconds in ((32 * K, "checkpoint,mst", "seco:chunk=4096", 11.99),
                                          (32 * K, "checkpoint,mst", "seco:chunk=4096:offload=true", 12.00),
                                          (64 * K, "checkpoint,mst", "seco:chunk=8192:offload=true", 34.18)):
        row = Row("H100", "docs/seco.md (2026-11-22)", f"lt:{engine}+{spec}", tokens, seconds,
                  lt.Strategy.parse(spec, engine=engine))
        _corrected_for_2026_11_23(row, config, shape)
        rows.append(row)
    for stored in json.loads((RESULTS / "planned_step.json").read_text())["rows"]:
        rows.append(Row("H200" if "H200" in stored["device"] else "H100", "planned_step.json", stored["strategy"],
                        int(stored["tokens"].replace(",", "")), stored["step_s"], lt.Strategy.parse(stored["strategy"]),
                        left_out="a whole training step, its AdamW update (pure bf16, the code of 2026-11-26) "
                                 "included; the model's rows are forward + backward"))
    return rows


def _corrected_for_2026_11_23(row: Row, config, shape) -> None:
    """The H100 code of 2026-11-22/23 ran the chunked head's forward once more in backward,
    and FPDT's recomputed layers still computed their MLP outputs: that work, in FLOPs."""
    head_fwd = 2.0 * row.tokens * shape.hidden * shape.vocab
    row.extra_flops = head_fwd
    if row.strategy.engine == "fpdt":
        row.extra_flops += 2.0 * row.tokens * shape.mlp_parameters() * shape.layers + head_fwd


def _error(row: Row, rates: MachineRates) -> float:
    return row.predict(rates) / row.measured - 1


def fit(rows: list[Row], prior: MachineRates, iterations: int = 30) -> MachineRates:
    """Gauss-Newton on log rates: log(predicted / measured) per row, and the prior's pull."""
    x = torch.tensor([math.log(getattr(prior, name)) for name in FITTED], dtype=torch.float64)
    x0 = x.clone()

    def rates_at(v: torch.Tensor) -> MachineRates:
        return dataclasses.replace(prior, **{name: math.exp(float(value)) for name, value in zip(FITTED, v)})

    def residuals(v: torch.Tensor) -> torch.Tensor:
        rates = rates_at(v)
        fitted = [math.log(row.predict(rates) / row.measured) for row in rows]
        return torch.tensor(fitted + list(PRIOR_WEIGHT * (v - x0)), dtype=torch.float64)

    for _ in range(iterations):
        r = residuals(x)
        jacobian = torch.stack([(residuals(x + 1e-6 * e) - r) / 1e-6 for e in torch.eye(len(FITTED), dtype=torch.float64)], 1)
        step = torch.linalg.lstsq(jacobian, -r.unsqueeze(1)).solution.squeeze(1)
        x = x + step
        if float(step.abs().max()) < 1e-7:
            break
    return rates_at(x)


def _ranked_wrong(rows: list[Row], rates: MachineRates) -> list[str]:
    wrong = []
    for a in rows:
        for b in rows:
            if (a.source, a.tokens) == (b.source, b.tokens) and a.measured < b.measured * (1 - NOISE):
                if a.predict(rates) >= b.predict(rates):
                    wrong.append(f"{a.tokens // K}K {a.case} ({a.measured:.2f} s) measured faster than "
                                 f"{b.case} ({b.measured:.2f} s), predicted slower")
    return wrong


def auto_on_the_h200(tokens: int, workers: int = 2) -> lt.Strategy:
    """What ``--strategy auto`` plans for the H200 rows' runs: Llama-3-8B, bf16, no optimizer
    step (gradients freed), the card's 143,771 MiB and half of its host's 128 GB, Liger carried."""
    from longtrain.plan.planner import PlanRequest, plan

    request = PlanRequest("llama3-8b", tokens, device_memory=143771 * 2**20, host_memory=67574282240, optimizer="none",
                          rates=H200, rates_name="h200", carried=("liger",))
    return lt.Strategy.from_dict(plan(request, workers=workers).best.strategy)


def auto_against_the_rows(rows: list[Row], lengths=(32 * K, 64 * K, 128 * K), workers: int = 2) -> list[dict]:
    """Per length: auto's plan at the H200 rates, its predicted step, and every measured H200
    case's predicted and measured step (auto is never predicted slower than one of them)."""
    found = []
    for tokens in lengths:
        chosen = auto_on_the_h200(tokens, workers)
        predicted = step_time(LLAMA, tokens, chosen, H200).seconds
        cases = [{"case": row.case, "source": row.source, "measured_s": row.measured, "predicted_s": row.predict(H200)}
                 for row in rows if row.card == "H200" and row.tokens == tokens and row.left_out is None]
        found.append({"tokens": tokens, "auto": chosen.label, "auto_predicted_s": predicted, "cases": cases,
                      "auto_predicted_fastest": all(predicted <= case["predicted_s"] for case in cases)})
    return found


def run(smoke: bool = False) -> dict:
    rows = _stored_rows()
    modelled = [row for row in rows if row.left_out is None]
    if smoke:
        modelled = [row for card in ("H100", "H200") for row in modelled if row.card == card][:2] + \
                   [row for row in modelled if row.card == "H200"][:2]
    tables, report = {}, []
    for card in ("H100", "H200"):
        mine = [row for row in modelled if row.card == card]
        prior = PRIOR_H100 if card == "H100" else dataclasses.replace(
            tables["H100"], elementwise=tables["H100"].elementwise * HBM["H200"] / HBM["H100"])
        tables[card] = fit(mine, prior, iterations=3 if smoke else 30)
        for row in mine:  # out of sample: the fit without the row, from the same prior
            out = None if smoke else _error(row, fit([r for r in mine if r is not row], prior))
            report.append((row, _error(row, tables[card]), out))
    builtin = {"H100": H100, "H200": H200}
    result_rows = []
    for row in rows:
        fitted = next(((e, o) for r, e, o in report if r is row), (None, None))
        result_rows.append({
            "card": row.card, "source": row.source, "case": row.case, "tokens": row.tokens, "measured_s": row.measured,
            "strategy": row.strategy.label if row.strategy else None, "left_out": row.left_out,
            "fit_error_pct": None if fitted[0] is None else 100 * fitted[0],
            "leave_one_out_error_pct": None if fitted[1] is None else 100 * fitted[1],
            "builtin_error_pct": None if row.left_out else 100 * _error(row, builtin[row.card]),
            "h100_table_error_pct": 100 * _error(row, builtin["H100"]) if row.card == "H200" and not row.left_out else None,
        })
    return {"tables": {card: dataclasses.asdict(t) for card, t in tables.items()}, "rows": result_rows,
            "ranked_wrong": {card: _ranked_wrong([r for r in modelled if r.card == card], builtin[card])
                             for card in builtin},
            "auto_h200": [] if smoke else auto_against_the_rows(rows)}


def _summary(rows: list[dict], key: str, card: str) -> str:
    errors = [abs(r[key]) for r in rows if r["card"] == card and r[key] is not None]
    if not errors:
        return "–"
    return f"{math.sqrt(sum(e * e for e in errors) / len(errors)):.1f}% rms, {max(errors):.1f}% max over {len(errors)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few rows, no leave-one-out (checks the script)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for time_model_fit.json/.md")
    args = parser.parse_args()
    result = run(smoke=args.smoke)
    lines = markdown(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/time_model_fit.py" + (" --smoke" if args.smoke else "")
    meta = {"generated": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "command": command}
    (out / "time_model_fit.json").write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
    (out / "time_model_fit.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def markdown(result: dict) -> list[str]:
    """The report's lines, from what :func:`run` returns (or the JSON it wrote)."""
    lines = ["# The time model refitted to every GPU row", "",
             "`python benchmarks/time_model_fit.py` (CPU; rows measured on one H100 80 GB, 2026-11-22/23, and one "
             "H200, 2026-11-26/30; Llama-3-8B, bf16, batch 1). Errors are predicted / measured − 1. *fit*: the "
             "fit of that card's rows; *out of sample*: a fit without the row (leave one out); *built in*: the "
             "tables in `longtrain.plan.time_model`; *H100 table*: an H200 row predicted with the H100's rates.", "",
             "| card | fit | out of sample | built in | H100 table |", "|---|---|---|---|---|"]
    for card in ("H100", "H200"):
        lines.append(f"| {card} | {_summary(result['rows'], 'fit_error_pct', card)} | "
                     f"{_summary(result['rows'], 'leave_one_out_error_pct', card)} | "
                     f"{_summary(result['rows'], 'builtin_error_pct', card)} | "
                     f"{_summary(result['rows'], 'h100_table_error_pct', card)} |")
    lines += ["", "| card | run | tokens | case | strategy modelled | measured s | fit | out of sample | built in |",
              "|---|---|---|---|---|---|---|---|---|"]

    def pct(value):
        return "–" if value is None else f"{value:+.1f}%"

    for r in result["rows"]:
        lines.append(f"| {r['card']} | {r['source']} | {r['tokens'] // K}K | {r['case']} | "
                     f"{'left out: ' + r['left_out'] if r['left_out'] else r['strategy']} | {r['measured_s']:.2f} | {pct(r['fit_error_pct'])} | "
                     f"{pct(r['leave_one_out_error_pct'])} | {pct(r['builtin_error_pct'])} |")
    lines += ["", "Fitted rates:", "", "| rate | " + " | ".join(result["tables"]) + " |",
              "|---|" + "---|" * len(result["tables"])]
    for name in FITTED:
        lines.append(f"| {name} | " + " | ".join(f"{t[name]:.3g}" for t in result["tables"].values()) + " |")
    lines += ["", f"Pairs ranked against their measured order (beyond {NOISE:.1%}, same run and length), built-in tables:", ""]
    for card, wrong in result["ranked_wrong"].items():
        lines.append(f"- {card}: " + ("none" if not wrong else "; ".join(wrong)))
    if result["auto_h200"]:
        lines += ["", "`--strategy auto` on the H200 rows' runs (Llama-3-8B, bf16, no optimizer step, 143,771 MiB, "
                  "half of 128 GB of host, Liger carried), planned at the H200 rates: its choice predicted against "
                  "every case measured at that length (predicted / measured s).", "",
                  "| tokens | auto chooses | predicted s | measured cases, predicted / measured s | auto predicted fastest |",
                  "|---|---|---|---|---|"]
        for entry in result["auto_h200"]:
            cases = "; ".join(f"{c['case']} {c['predicted_s']:.2f} / {c['measured_s']:.2f}" for c in entry["cases"])
            lines.append(f"| {entry['tokens'] // K}K | `{entry['auto']}` | {entry['auto_predicted_s']:.2f} | {cases} | "
                         f"{'yes' if entry['auto_predicted_fastest'] else '**no**'} |")
    return lines


if __name__ == "__main__":
    main()
