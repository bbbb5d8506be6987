"""Run under ``torchrun --nproc-per-node R``: for each case, one adjoint step of a 4-layer
float64 SSM-ResNet, Mamba or Mamba-2 (embeddings tied or not) with its layers split over R
ranks (gloo), two micro-batches accumulated; each rank saves the gradients of the parameters
it owns and the loss it reports (``CASE/rankR.pt``). Cases: ``TRUNCATE,PRESET,tied|untied``
(0: not truncated), run one after another in one launch. Used by test_adjoint_distributed.py."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import longtrain as lt
from longtrain.engines.adjoint import AdjointOptions
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config
from longtrain.parallel.distributed import init_from_env
from longtrain.parallel.layer_groups import owned_parameters, shard_model
from longtrain.strategy import applied_context


def build_model_and_batch(truncate: int | None, preset: str = "tiny-ssm", tied: bool = False):
    """The model, two micro-batches (the second right-padded) and the engine's options (a
    Mamba's scan in chunks of 16 tokens)."""
    torch.manual_seed(0)
    model = build_from_config(preset_config(preset, num_hidden_layers=4, tie_word_embeddings=tied), torch.float64)
    batches = []
    for seed in (1, 2):
        ids = torch.randint(0, 320, (2, 45), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        mask[1, 30:] = 0 if seed == 2 else 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return model, batches, AdjointOptions(truncate=truncate, block=8, chunk=16 if "mamba" in preset else None)


def case_name(truncate: int | None, preset: str, tied: bool) -> str:
    return f"{truncate or 0},{preset},{'tied' if tied else 'untied'}"


def run_case(out_dir: Path, rank: int, world_size: int, truncate: int | None, preset: str, tied: bool) -> None:
    model, batches, options = build_model_and_batch(truncate, preset, tied)
    lt.apply(model, lt.Strategy(engine="adjoint", engine_options=options))
    shard_model(applied_context(model), rank, world_size)
    loss = torch.stack([lt.step(model, batch) for batch in batches])
    owned = {name: p.grad for name, p in owned_parameters(model).items()}
    kept = sum(p.numel() for p in owned_parameters(model).values())
    where = out_dir / case_name(truncate, preset, tied)
    where.mkdir(parents=True, exist_ok=True)
    torch.save({"loss": loss, "grads": owned, "parameters": kept}, where / f"rank{rank}.pt")


def main(out_dir: str, cases: list[str]) -> None:
    rank, world_size = init_from_env()
    for case in cases:
        truncate, preset, tied = case.split(",")
        run_case(Path(out_dir), rank, world_size, int(truncate) or None, preset, tied == "tied")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
