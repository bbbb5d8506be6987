"""Which model families longtrain trains exactly, checked on the installed transformers.

For each causal-LM family transformers knows, :func:`check_family` builds a tiny model
from its config (two layers, random weights, float64), and compares one step of every
engine and technique with stock autograd on the same model — loss and every gradient,
relative error at most 1e-10 — on right-padded, left-padded and packed batches whose
lengths divide no chunk. A family is *exact* when every comparison passes, *refused*
when longtrain refuses it (one line, the reason), and *inexact* otherwise. Families
without an adapter are tried with the Llama-layout adapter, which tells whether
registering the family's name would be enough.

``longtrain families`` writes the table (``docs/families.md``) and its JSON.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from .errors import LongtrainError

__all__ = ["BATCHES", "STRATEGIES", "FamilyResult", "causal_families", "check_family", "check_in_process", "float64_throughout",
           "tiny_config", "write_table"]

TOLERANCE = 1e-10
VOCAB = 320

# Small enough to run every family in seconds; heads ≠ K/V heads (grouped K/V), a
# sliding window shorter than the sequence, two experts of four per token.
_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, moe_intermediate_size=32,
             num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4,
             shared_expert_intermediate_size=48, shared_intermediate_size=48, sliding_window=24,
             attention_chunk_size=24, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             output_router_logits=False, use_cache=False)


def causal_families() -> list[str]:
    """Every decoder-only ``model_type`` transformers maps to a causal-LM class (not the
    decoders of encoder-decoder models, nor encoder families with a causal-LM head)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    families = []
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(family)
        except Exception:  # noqa: BLE001 - a family whose default config does not build is no candidate
            continue
        if not getattr(config, "is_encoder_decoder", False) and family not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            families.append(family)
    return families


def tiny_config(family: str):
    """``family``'s default config shrunk to :data:`_TINY` (fields it has), every dropout 0."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in _TINY.items():
        if hasattr(config, key):  # fields it has, under their own names or the attribute map's
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, value)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
        elif isinstance(value, list) and layers and len(value) == layers and key != "architectures":
            setattr(config, key, value[:config.num_hidden_layers])
    return config


@contextlib.contextmanager
def float64_throughout():
    """Norms, softmaxes and routers that compute in float32 whatever their input keep
    float64 inputs in float64, for the stock model and longtrain's alike. Identical
    inputs round identically, but a chunked engine sums attention in another order, and
    float32 rounding of a 1e-16 difference would hide the method's own error."""
    to, softmax = torch.Tensor.to, F.softmax

    def keep_float64(self, *args, **kwargs):
        wanted = kwargs.get("dtype", args[0] if args and isinstance(args[0], torch.dtype) else None)
        if wanted == torch.float32 and self.dtype == torch.float64:
            return self
        return to(self, *args, **kwargs)

    def float_keeping(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to(self, torch.float32)

    def softmax_keeping(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype)

    with mock.patch.object(torch.Tensor, "to", keep_float64), mock.patch.object(torch.Tensor, "float", float_keeping), \
            mock.patch.object(F, "softmax", softmax_keeping):
        yield


def _padded(left: bool) -> dict:
    generator = torch.Generator().manual_seed(1)
    lengths, width = (37, 26), 37
    ids = torch.randint(3, VOCAB, (2, width), generator=generator)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, width - n:] = 1
        else:
            mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    if left:  # a left-padded row's first token is predicted by a position that sees no key
        labels[1, width - lengths[1]] = -100
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}


def _packed() -> dict:
    generator = torch.Generator().manual_seed(2)
    documents = ((15, 13, 9), (37,))
    ids = torch.randint(3, VOCAB, (2, 37), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    return {"input_ids": ids, "labels": ids.masked_fill(positions == 0, -100), "position_ids": positions}


BATCHES = {"right-padded": lambda: _padded(False), "left-padded": lambda: _padded(True), "packed": _packed}


def _strategies() -> dict:
    import longtrain as lt

    # Chunks of 11 and 14 tokens divide neither 37 nor a document; MsT's 7-token tiles neither.
    return {
        "backprop": lambda: lt.Strategy(),
        "checkpoint": lambda: lt.Strategy(checkpoint=True),
        "mst": lambda: lt.Strategy(mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=7)),
        "checkpoint,mst": lambda: lt.Strategy(checkpoint=True, mst=lt.MsTOptions(loss_chunks=3, mlp_chunk=7)),
        "memo": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=0.3, keep_last=1)),
        "memo:alpha=1": lambda: lt.Strategy(memo=lt.MemoOptions(alpha=1.0, keep_last=1)),
        "fpdt": lambda: lt.Strategy(engine="fpdt", engine_options={"chunk": 11}),
        "fpdt:offload,keep_output,mst": lambda: lt.Strategy(
            engine="fpdt", engine_options={"chunk": 14, "offload": True, "keep_output": 1}, mst=lt.MsTOptions(loss_chunks=3)),
        "seco,checkpoint": lambda: lt.Strategy(engine="seco", engine_options={"chunk": 11}, checkpoint=True),
        "spaco(every chunk)": lambda: lt.Strategy(engine="spaco", engine_options={"chunk": 14, "budget": 8}),
    }


STRATEGIES = tuple(["backprop", "checkpoint", "mst", "checkpoint,mst", "memo", "memo:alpha=1", "fpdt", "fpdt:offload,keep_output,mst",
                    "seco,checkpoint", "spaco(every chunk)"])


@dataclass
class FamilyResult:
    """One family's verdict: ``status`` is ``exact``, ``refused``, ``inexact`` or ``not built``;
    ``cells`` maps ``strategy`` to its worst relative error over the batches, or to the
    line it was refused with."""

    family: str
    status: str
    adapter: str | None = None  # the adapter that ran it (None: none registered, tried with the Llama layout)
    reason: str | None = None
    cells: dict = field(default_factory=dict)
    seconds: float = 0.0


def _stock_loss(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   position_ids=batch.get("position_ids"), use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative_error(loss, ref, ours: dict, stock: dict) -> float:
    if ours.keys() != stock.keys() or not ours:
        return float("inf")
    error = abs(float(loss) - float(ref)) / abs(float(ref))
    for name, g in ours.items():
        error = max(error, float((g - stock[name]).norm() / stock[name].norm().clamp_min(1e-300)))
    return error


def _build_pair(config):
    """The stock model (SDPA, or eager where logits are soft-capped) and longtrain's build,
    with identical float64 weights."""
    from transformers import AutoModelForCausalLM

    from .models.loading import build_from_config, default_dtype

    # Experts one by one: the grouped-matmul kernels take no float64.
    stock_kwargs = {"attn_implementation": "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa",
                    "experts_implementation": "eager"}
    ours = build_from_config(copy.deepcopy(config), torch.float64)
    ours.config._experts_implementation = "eager"
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), **stock_kwargs)
    ours.load_state_dict(stock.state_dict())
    return stock.train(), ours.train()


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300] if not isinstance(error, LongtrainError) else text[:300]


def check_family(family: str, strategies: tuple[str, ...] = STRATEGIES) -> FamilyResult:
    """Build ``family`` tiny and compare every strategy with stock autograd (see the module)."""
    from . import strategy as lt
    from .models.adapters import base as adapters

    started = time.perf_counter()
    registered = family in adapters.supported_families()
    result = FamilyResult(family, "exact", adapters.adapter_class(family).__name__ if registered else None)
    if registered and not adapters.adapter_class(family).has_attention:
        return _finish(result, "attention-free", "an SSM: its engines are proven in tests/test_mamba.py, "
                                                 "tests/test_mamba2.py and tests/test_adjoint.py", started)
    try:
        config = tiny_config(family)
        stock, ours = _build_pair(config)
        if registered:
            adapters.adapter_for(ours)  # the family's own checks refuse here, in one line
    except LongtrainError as error:
        return _finish(result, "refused", _one_line(error), started)
    except Exception as error:  # noqa: BLE001 - a family transformers cannot build tiny is reported, not raised
        return _finish(result, "not built", _one_line(error), started)
    makers = _strategies()
    with _registered_as_llama(family, registered), float64_throughout():
        for name in strategies:
            worst = 0.0
            for batch_name, make_batch in BATCHES.items():
                batch = make_batch()
                s, o = copy.deepcopy(stock), copy.deepcopy(ours)
                try:
                    ref = _stock_loss(s, batch)
                    ref.backward()
                    lt.apply(o, makers[name]())
                    loss = lt.step(o, batch)
                    worst = max(worst, _relative_error(loss, ref.detach(), _grads(o), _grads(s)))
                except LongtrainError as error:
                    worst = _one_line(error)
                    break
                except Exception as error:  # noqa: BLE001 - recorded as this cell's failure
                    worst = f"{batch_name}: {_one_line(error)}"
                    break
            result.cells[name] = worst
    errors = [v for v in result.cells.values() if isinstance(v, float)]
    failures = [v for v in result.cells.values() if isinstance(v, str) or v > TOLERANCE]
    if failures and not errors:
        return _finish(result, "refused", str(failures[0]), started)
    if any(isinstance(v, float) and v > TOLERANCE or isinstance(v, str) and not _is_refusal(v) for v in failures):
        return _finish(result, "inexact", None, started)
    return _finish(result, "exact", None, started)


def check_in_process(family: str, timeout: float = 120.0) -> FamilyResult:
    """:func:`check_family` in a forked process: a family whose tiny build hangs or
    crashes the interpreter is reported as not built, and the next one runs."""
    import multiprocessing

    from . import strategy  # noqa: F401  (imported once here, inherited by every forked check)

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    worker = context.Process(target=_check_into, args=(family, queue), daemon=True)
    started = time.perf_counter()
    worker.start()
    try:
        return FamilyResult(**queue.get(timeout=timeout))
    except Exception:  # noqa: BLE001 - the queue stays empty: the worker hung or died
        reason = f"no verdict within {timeout:.0f} s" if worker.is_alive() else f"the check exited with code {worker.exitcode}"
        return _finish(FamilyResult(family, "not built"), "not built", reason, started)
    finally:
        if worker.is_alive():
            worker.kill()
        worker.join()


def _check_into(family: str, queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny models gain nothing from more; idle OpenMP threads spin beside other work
    queue.put(asdict(check_family(family)))


def _is_refusal(cell: str) -> bool:
    return ":" not in cell.split(" ", 1)[0]  # a LongtrainError's line, not "batch: Exception: ..."


def _finish(result: FamilyResult, status: str, reason: str | None, started: float) -> FamilyResult:
    result.status, result.reason, result.seconds = status, reason, round(time.perf_counter() - started, 2)
    return result


@contextlib.contextmanager
def _registered_as_llama(family: str, registered: bool):
    """A family without an adapter, tried with the Llama-layout one for the length of the check."""
    from .models.adapters import base as adapters

    if registered:
        yield
        return
    adapters._ADAPTERS[family] = adapters.DecoderAdapter
    try:
        yield
    finally:
        adapters._ADAPTERS.pop(family, None)


def _cell(value) -> str:
    if isinstance(value, float):
        return "✓" if value <= TOLERANCE else f"✗ {value:.1e}"
    return "refused" if _is_refusal(value) else "error"


def merged(results: list[FamilyResult], previous: Path) -> list[FamilyResult]:
    """``results`` in place of the same families' rows of an earlier table's JSON."""
    old = json.loads(previous.read_text())["results"] if previous.is_file() else []
    fresh = {r.family: r for r in results}
    rows = [fresh.pop(row["family"], None) or FamilyResult(**row) for row in old]
    return rows + list(fresh.values())


def write_table(results: list[FamilyResult], out: Path, transformers_version: str, command: str) -> None:
    """``out`` (markdown) and ``out`` with ``.json``: the supported families with every
    strategy's verdict, then the others with what the Llama-layout adapter made of them."""
    ssms = [r for r in results if r.status == "attention-free"]
    supported = [r for r in results if r.adapter and r not in ssms]
    others = [r for r in results if not r.adapter]
    exact = [r for r in supported if r.status == "exact"]
    lines = [
        "# Model families",
        "",
        f"Generated by `{command}` on transformers {transformers_version}. Each family is built tiny",
        "(2 layers, float64, grouped K/V heads, a 24-token sliding window where the family has one, 4 experts",
        "with 2 active where it is a mixture of experts) and one step of each strategy is compared with stock",
        "autograd on right-padded, left-padded and packed batches of 37 tokens (chunks of 11 and 14 tokens,",
        f"MLP tiles of 7). ✓: the loss and every gradient within {TOLERANCE:g} (relative); refused: longtrain",
        "refuses that strategy for the family in one line (listed below the tables).",
        "",
        "## Supported",
        "",
        f"{len(exact)} families, exact under every engine and technique:",
        "",
        "| family | verdict | " + " | ".join(STRATEGIES) + " |",
        "|" + "---|" * (2 + len(STRATEGIES)),
    ]
    for r in supported:
        cells = [_cell(r.cells[s]) if s in r.cells else "" for s in STRATEGIES]
        lines.append(f"| `{r.family}` | {r.status} | " + " | ".join(cells) + " |")
    if ssms:
        lines += ["", "State-space models, attention-free (backprop, checkpointing, MsT's head and the adjoint engine; "
                  "[adjoint.md](adjoint.md)): " + ", ".join(f"`{r.family}`" for r in ssms) + "."]
    lines += ["", "Refused strategies:", ""]
    for r in supported:
        for reason in sorted({v for v in r.cells.values() if isinstance(v, str)} | ({r.reason} if r.reason else set())):
            lines.append(f"- `{r.family}`: {reason}")
    lines += [
        "", "## Not supported", "",
        "Refused by every engine and technique in one line (\"longtrain does not support ... models\"). The second",
        "column says what the Llama-layout adapter makes of the family: *would be exact* (registering its name",
        "is all it needs), *inexact* (it runs, but not equal to stock), *layout differs* (it cannot run it), or",
        "*not built* (transformers cannot build it tiny here).",
        "",
        "| family | with the Llama-layout adapter | first difference |",
        "|---|---|---|",
    ]
    for r in others:
        lines.append(f"| `{r.family}` | {_other_verdict(r)} | {_first_difference(r)} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"transformers": transformers_version, "command": command,
                                                    "results": [asdict(r) for r in results]}, indent=1) + "\n")


def _other_verdict(r: FamilyResult) -> str:
    return {"exact": "would be exact", "refused": "layout differs"}.get(r.status, r.status)


def _first_difference(r: FamilyResult) -> str:
    if r.reason:
        text = r.reason
    else:
        worst = [(name, v) for name, v in r.cells.items() if not isinstance(v, float) or v > TOLERANCE]
        if not worst:
            return ""
        name, v = worst[0]
        text = f"{name}: relative error {v:.1e}" if isinstance(v, float) else f"{name}: {v}"
    return text.replace("|", "\\|")[:160]
