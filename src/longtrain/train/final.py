"""What a finished run leaves in --out besides its summary: the final evaluation's
record in metrics.jsonl, the trained model in final/ and the metrics.png plot.

final/ is replaced as a whole (written beside, then swapped in), and the evaluation is
logged once, so a run stopped while finishing and then resumed leaves the same files as
one that finished at once.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import writing
from ..models.loading import is_model_dir
from ..strategy import weights_on_device
from .config import TrainConfig
from .metrics import read_metrics, strict_json
from .plot import plot_metrics

__all__ = ["log_final_evaluation", "plot_run", "save_final"]


def log_final_evaluation(out: Path, step: int, evaluation: dict) -> None:
    """Append the evaluation at ``step`` to metrics.jsonl, unless it holds one at this step
    already (a run stopped while writing its final model logged it before)."""
    path = out / "metrics.jsonl"
    if path.exists() and any("eval" in r and r.get("step") == step for r in read_metrics(path)):
        return
    with writing("the metrics log", path), open(path, "a") as f:
        f.write(strict_json({"step": step, "eval": evaluation}) + "\n")


def plot_run(out: Path) -> None:
    """metrics.png beside metrics.jsonl, over the whole run (resumed parts included)."""
    if plot_metrics(read_metrics(out / "metrics.jsonl"), out / "metrics.png") is None:
        print("longtrain train: no metrics.png (matplotlib is not installed: pip install matplotlib)", flush=True)


def save_final(model, tokenizer, out: Path, config: TrainConfig) -> None:
    """The trained model in final/, replaced as a whole: written beside, then swapped in."""
    final = out / "final"
    tmp, old = out / f".final.tmp-{os.getpid()}", out / f".final.old-{os.getpid()}"
    with writing("the final model", final, "continue with --resume"):
        try:
            if config.lora:
                _save_lora(model, tokenizer, tmp, out, config)
            else:
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)


def _save_lora(peft_model, tokenizer, final: Path, out: Path, config: TrainConfig) -> None:
    """A LoRA run's final/: the merged model (what transformers and `longtrain train
    --model` load) and, in final/adapter, the adapter for peft. The adapter names its
    base by absolute path: the --model directory, or for a preset (random weights that
    exist only in this run) the base saved in final/base. Merging is the last use of
    the model, so it is done in place."""
    base = peft_model.get_base_model()
    adapter = peft_model.peft_config[peft_model.active_adapter]
    if is_model_dir(config.model):
        adapter.base_model_name_or_path = os.path.abspath(config.model)
    else:
        base_weights = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
        base.save_pretrained(final / "base", state_dict=base_weights)
        tokenizer.save_pretrained(final / "base")
        adapter.base_model_name_or_path = os.path.abspath(out / "final" / "base")
    # save_embedding_layers=False: peft would otherwise look the base up on the Hub to
    # decide whether to save embeddings; nothing here trains them.
    peft_model.save_pretrained(final / "adapter", save_embedding_layers=False)
    weights_on_device(peft_model)  # streamed base weights: merged where the adapters are
    peft_model.merge_and_unload().save_pretrained(final)
