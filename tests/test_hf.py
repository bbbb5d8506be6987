"""longtrain.hf: a Hugging Face Trainer / TRL SFTTrainer whose step is lt.step equals the stock
one. Float64 tiny models from configs, a tokenizer built here (nothing is downloaded); each
comparison runs one optimizer step of two accumulated micro-batches (a packed padding-free
one and a padded one, completion-only labels) through the stock trainer and ours, and
compares the parameters after it and the losses the steps returned."""

from __future__ import annotations

import importlib.util
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import packed_batch, padded_batch, stock_and_ours, stock_lora_and_ours
from transformers import Trainer, TrainingArguments

import longtrain as lt
from longtrain.hf import LongtrainTrainer, wrap

REPO = Path(__file__).resolve().parents[1]
VOCAB = 320


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub lookups and no telemetry (TRL's trainers send some when built)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)


def float64_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                           **kwargs):
    """Transformers' ForCausalLMLoss without its cast to float32 (which would round a float64
    model's loss to ~1e-7): the same shift, sum and division."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def in_float64(model):
    """``model`` (or a PEFT model's base) computing its Hugging Face loss in float64."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.loss_function = float64_causal_lm_loss
    return model


def completion_only(batch: dict, prompt: int = 9) -> dict:
    """``batch`` with no loss on each document's first ``prompt`` tokens (its prompt)."""
    batch = dict(batch)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    batch["labels"] = batch["labels"].masked_fill(positions < prompt, -100)
    return batch


# Micro-batch 0: two rows of packed documents without padding (position ids restart, as a
# padding-free collator makes them); micro-batch 1: two right-padded rows. The sampler's
# seed decides their order, the same for both trainers.
MICRO_BATCHES = [
    completion_only(packed_batch(VOCAB, documents=((20, 13, 15), (30, 18)))),
    completion_only(padded_batch(VOCAB, lengths=(37, 26))),
]


class Batches(torch.utils.data.Dataset):
    """Dataset item i is micro-batch i, collated as it is (per_device_train_batch_size=1)."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return index

    def collate(self, indices):
        (index,) = indices
        return {k: v.clone() for k, v in self.batches[index].items()}


def training_args(out, **overrides) -> TrainingArguments:
    settings = dict(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                    per_device_train_batch_size=1, per_device_eval_batch_size=1, gradient_accumulation_steps=2,
                    max_steps=1, optim="sgd",
                    learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
                    save_strategy="no", seed=0, dataloader_num_workers=0)
    return TrainingArguments(**{**settings, **overrides})


def recording(trainer):
    """``trainer`` with the loss of every training step it returns kept in ``trainer.step_losses``."""
    trainer.step_losses = []
    step = trainer.training_step

    def recorded(*args, **kwargs):
        loss = step(*args, **kwargs)
        trainer.step_losses.append(float(loss))
        return loss

    trainer.training_step = recorded
    return trainer


def train(trainer, mean_per_batch: bool = False):
    """One optimizer step; ``mean_per_batch``: as for a model that takes no loss kwargs (the
    Trainer then counts no num_items_in_batch and divides each micro-batch's mean by the
    accumulation steps)."""
    if mean_per_batch:
        trainer.model_accepts_loss_kwargs = False
    recording(trainer).train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}, trainer.step_losses


def max_rel(a: dict, b: dict, before: dict | None = None) -> float:
    """Largest relative difference of ``a`` and ``b`` (of their changes from ``before``)."""
    assert a.keys() == b.keys() and a
    if before is not None:
        a, b = ({k: d[k] - before[k] for k in d} for d in (a, b))
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-300)) for k in a)


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory):
    """The stock Trainer's step on tiny-llama, once per loss normalisation: (params before,
    params after, step losses)."""
    runs = {}
    for mean in (False, True):
        stock, _ = stock_and_ours("tiny-llama")
        before = {n: p.detach().clone() for n, p in stock.named_parameters()}
        data = Batches(MICRO_BATCHES)
        trainer = Trainer(model=in_float64(stock), args=training_args(tmp_path_factory.mktemp("stock")),
                          train_dataset=data, data_collator=data.collate)
        runs[mean] = (before, *train(trainer, mean))
    return runs


STRATEGIES = {
    "backprop": None,
    "checkpoint,mst": "checkpoint,mst:loss_chunks=3:mlp_chunk=17",
    "memo": "memo:alpha=0.3:keep_last=1,mst",
    "fpdt": "fpdt:chunk=16",
    "seco": "seco:chunk=16",
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_trainer_step_equals_stock(name, stock_runs, tmp_path):
    before, stock_params, stock_losses = stock_runs[False]
    _, ours = stock_and_ours("tiny-llama")
    data = Batches(MICRO_BATCHES)
    trainer = LongtrainTrainer(model=ours, args=training_args(tmp_path), train_dataset=data, data_collator=data.collate,
                               strategy=STRATEGIES[name])
    params, losses = train(trainer)
    assert lt.strategy.applied_strategy(ours) == trainer.strategy
    assert max_rel(params, stock_params, before) <= 1e-10
    assert len(losses) == 2 and all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, stock_losses))
    assert trainer.state.log_history[0]["loss"] == pytest.approx(sum(stock_losses), rel=1e-6)


def test_trainer_mean_per_micro_batch_equals_stock(stock_runs, tmp_path):
    """Without num_items_in_batch (a model taking no loss kwargs), each micro-batch's mean
    loss divided by the accumulation steps, as stock."""
    before, stock_params, stock_losses = stock_runs[True]
    _, ours = stock_and_ours("tiny-llama")
    data = Batches(MICRO_BATCHES)
    trainer = LongtrainTrainer(model=ours, args=training_args(tmp_path), train_dataset=data, data_collator=data.collate,
                               strategy="checkpoint")
    params, losses = train(trainer, mean_per_batch=True)
    assert max_rel(params, stock_params, before) <= 1e-10
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, stock_losses))
    assert max_rel(params, stock_runs[False][1], before) > 1e-3  # the two normalisations differ


def test_a_trainer_that_logs_no_token_metrics_does_not_compute_them(tmp_path, monkeypatch):
    """Entropy and top-1 hits cost passes over every tile's logits: only a trainer that logs
    TRL's token metrics (SFTTrainer) has the step count them."""
    from longtrain.ops.token_stats import TokenStats

    def refused(*args, **kwargs):
        raise AssertionError("token metrics computed for a trainer that does not log them")

    monkeypatch.setattr(TokenStats, "add", refused)
    train(tiny_trainer(tmp_path, strategy="checkpoint,mst"))


def test_model_init_gets_the_strategy_at_its_first_step(stock_runs, tmp_path):
    """A model that model_init builds again inside train() is trained with the strategy too."""
    before, stock_params, _ = stock_runs[False]
    built = []

    def model_init(trial=None):
        built.append(stock_and_ours("tiny-llama")[1])
        return built[-1]

    data = Batches(MICRO_BATCHES)
    trainer = LongtrainTrainer(model_init=model_init, args=training_args(tmp_path), train_dataset=data,
                               data_collator=data.collate, strategy="seco:chunk=16")
    params, _ = train(trainer)
    assert len(built) == 2 and lt.strategy.applied_strategy(built[-1]) == trainer.strategy
    assert max_rel(params, stock_params, before) <= 1e-10


def test_lora_step_and_evaluation_equal_stock(tmp_path):
    stock, ours = stock_lora_and_ours("tiny-llama")
    before = {n: p.detach().clone() for n, p in stock.named_parameters() if p.requires_grad}
    data = Batches(MICRO_BATCHES)
    results = []
    for model, cls, kwargs in ((stock, Trainer, {}), (ours, LongtrainTrainer, {"strategy": "fpdt:chunk=16,mst"})):
        trainer = cls(model=in_float64(model), args=training_args(tmp_path / cls.__name__, optim="adamw_torch"),
                      train_dataset=data, eval_dataset=data, data_collator=data.collate, **kwargs)
        params, losses = train(trainer)
        results.append((params, losses, trainer.evaluate()["eval_loss"]))
    (stock_params, stock_losses, stock_eval), (params, losses, eval_loss) = results
    assert params.keys() == before.keys() and all("lora" in n for n in params)
    assert max_rel(params, stock_params, before) <= 1e-10
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, stock_losses))
    assert eval_loss == pytest.approx(stock_eval, rel=1e-10)  # Hugging Face's forward through longtrain's attention


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32])
def test_bf16_autocast_trains_as_stock(tmp_path, weights):
    """bf16=True (Accelerate's autocast) over bfloat16 weights, and over float32 ones (mixed
    precision: attention takes its inputs in bfloat16, as stock SDPA under autocast does),
    trains as stock does, to bf16's precision (the loss and the gradient norm)."""
    stock, ours = stock_and_ours("tiny-llama", dtype=weights)
    data = Batches(MICRO_BATCHES)
    logged = []
    for model, cls, kwargs in ((stock, Trainer, {}), (ours, LongtrainTrainer, {"strategy": "checkpoint,mst"})):
        trainer = cls(model=model, args=training_args(tmp_path / cls.__name__, bf16=True), train_dataset=data,
                      data_collator=data.collate, **kwargs)
        _, losses = train(trainer)
        logged.append((losses, trainer.state.log_history[0]["grad_norm"]))
    (stock_losses, stock_norm), (losses, norm) = logged
    assert losses == pytest.approx(stock_losses, rel=1e-2) and norm == pytest.approx(stock_norm, rel=2e-2)


def test_resume_continues_as_an_uninterrupted_run(tmp_path):
    """Three AdamW steps with warm-up and decay, uninterrupted, equal two steps, a checkpoint
    and a resumed third (weights, optimizer, scheduler, RNG and data position restored)."""
    batches = [completion_only(padded_batch(VOCAB, lengths=(29, 21), seed=s)) for s in range(6)]

    def run(out, resume=None):
        _, ours = stock_and_ours("tiny-llama")
        data = Batches(batches)
        args = training_args(out, optim="adamw_torch", learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
                             max_steps=3, save_strategy="steps", save_steps=2)
        trainer = LongtrainTrainer(model=ours, args=args, train_dataset=data, data_collator=data.collate,
                                   strategy="checkpoint,mst")
        trainer.train(resume_from_checkpoint=resume)
        return {n: p.detach().clone() for n, p in ours.named_parameters()}

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert max_rel(resumed, whole) <= 1e-10


# ---- what is taken over, refused, planned ----------------------------------------------


def tiny_trainer(tmp_path, model=None, args=None, **kwargs):
    """A LongtrainTrainer on ``model`` (tiny-llama by default) and the micro-batches above."""
    model = model if model is not None else stock_and_ours("tiny-llama")[1]
    data = Batches(MICRO_BATCHES)
    return LongtrainTrainer(model=model, args=args or training_args(tmp_path), train_dataset=data,
                            data_collator=data.collate, **kwargs)


@pytest.mark.parametrize("strategy, on_model, applied", [
    (None, False, "checkpoint"),  # activation_checkpointing=True becomes longtrain's checkpoint
    ("fpdt:chunk=16", False, "fpdt:chunk=16"),  # the engine recomputes its own way: only switched off
    ("mst", True, "checkpoint,mst"),  # enabled on the model itself (activation_checkpointing_enable())
])
def test_hugging_face_checkpointing_is_taken_over(strategy, on_model, applied, tmp_path):
    _, ours = stock_and_ours("tiny-llama")
    if on_model:
        ours.activation_checkpointing_enable()
    trainer = tiny_trainer(tmp_path, ours, training_args(tmp_path, activation_checkpointing=not on_model), strategy=strategy)
    assert trainer.strategy == lt.Strategy.parse(applied)
    assert not trainer.args.activation_checkpointing and not trainer.args.gradient_checkpointing
    assert not any(getattr(m, "gradient_checkpointing", False) for m in ours.modules())


def _parallelism(**sizes):
    from accelerate import ParallelismConfig

    return ParallelismConfig(**sizes)


ARGUMENT_REFUSALS = {
    "deepspeed": (lambda mp, a: setattr(a, "deepspeed", {"train_micro_batch_size_per_gpu": 1}),
                  "parallelism_config=ParallelismConfig(sp_size=P)"),
    "fsdp1": (lambda mp, a: (setattr(a, "fsdp", ["full_shard"]), setattr(a, "fsdp_config", {"version": 1})),
              "fsdp_config={'version': 2}"),
    "tensor_parallel": (lambda mp, a: setattr(a, "parallelism_config", _parallelism(tp_size=2)),
                        "set ParallelismConfig(sp_size=P) alone"),
    "sp_with_fsdp": (lambda mp, a: (setattr(a, "parallelism_config", _parallelism(sp_size=2)), setattr(a, "fsdp", ["full_shard"]),
                                    setattr(a, "fsdp_config", {"version": 2})), "drop fsdp="),
    "DataParallel": (lambda mp, a: setattr(a, "_n_gpu", 2), "CUDA_VISIBLE_DEVICES=0"),
    "fp16": (lambda mp, a: setattr(a, "fp16", True), "bf16=True"),
    "torch_compile": (lambda mp, a: setattr(a, "torch_compile", True), "torch_compile=False"),
    "lomo": (lambda mp, a: setattr(a, "optim", "lomo"), "pick another optimizer"),
    "use_liger_kernel": (lambda mp, a: setattr(a, "use_liger_kernel", True), "'checkpoint,mst,liger'"),
    "label_smoothing": (lambda mp, a: setattr(a, "label_smoothing_factor", 0.1), "label_smoothing_factor=0"),
    "dft": (lambda mp, a: setattr(a, "loss_type", "dft"), "loss_type='nll'"),
    "activation_offloading": (lambda mp, a: setattr(a, "activation_offloading", True), "'fpdt:offload=true'"),
}


@pytest.mark.parametrize("case", ARGUMENT_REFUSALS)
def test_refused_arguments_in_one_line(case, tmp_path, monkeypatch):
    change, fix = ARGUMENT_REFUSALS[case]
    args = training_args(tmp_path)
    change(monkeypatch, args)
    with pytest.raises(lt.LongtrainError) as refused:
        tiny_trainer(tmp_path, args=args, strategy="checkpoint")
    assert "\n" not in str(refused.value) and fix in str(refused.value)


def test_refused_trainers_strategies_and_batches_in_one_line(tmp_path):
    def refused(fix, build):
        with pytest.raises(lt.LongtrainError) as caught:
            build()
        assert "\n" not in str(caught.value) and fix in str(caught.value), str(caught.value)

    _, split = stock_and_ours("tiny-llama")
    split.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    refused("device_map=None", lambda: tiny_trainer(tmp_path, split))
    refused("drop it", lambda: tiny_trainer(tmp_path, compute_loss_func=lambda outputs, labels, **kw: outputs.loss))
    refused("parallelism_config=ParallelismConfig(sp_size=2)", lambda: tiny_trainer(tmp_path, strategy="fpdt:chunk=16+sp2"))
    refused("has no option 'chunks'", lambda: tiny_trainer(tmp_path, strategy="fpdt:chunks=16"))
    refused("trl.SFTTrainer", lambda: wrap(dict))
    refused("Weighted.compute_loss", lambda: wrap(type("Weighted", (Trainer,), {"compute_loss": lambda *a, **k: 0})))
    refused("overrides training_step in Stepping", lambda: wrap(type("Stepping", (Trainer,), {"training_step": lambda *a: 0})))
    assert wrap(Trainer) is LongtrainTrainer

    trainer = tiny_trainer(tmp_path, strategy="checkpoint")
    model, batch = trainer.model, MICRO_BATCHES[1]
    refused("shift_labels", lambda: trainer.training_step(model, {**batch, "shift_labels": batch["labels"]}))
    refused("no 'labels'", lambda: trainer.training_step(model, {"input_ids": batch["input_ids"]}))
    refused("'pixel_values' is not read", lambda: trainer.training_step(model, {**batch, "pixel_values": batch["labels"]}))
    refused("'label' is not read by longtrain.step", lambda: lt.step(model, {"input_ids": batch["input_ids"],
                                                                              "label": batch["labels"]}))
    refused("num_label_tokens=0 divides the loss", lambda: lt.step(model, batch, num_label_tokens=0))
    unlabelled = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    loss = trainer.training_step(model, unlabelled, num_items_in_batch=torch.tensor(40.0))
    assert float(loss) == 0 and all(p.grad is None for p in model.parameters())  # nothing to learn: no step


def test_the_cache_is_emptied_every_torch_empty_cache_steps(tmp_path, monkeypatch):
    """``torch_empty_cache_steps`` as the stock step honours it (accelerate's clear_device_cache)."""
    cleared = []
    monkeypatch.setattr("accelerate.utils.memory.clear_device_cache", lambda *a, **k: cleared.append(1))
    trainer = tiny_trainer(tmp_path, strategy="checkpoint", args=training_args(tmp_path, torch_empty_cache_steps=1))
    trainer.train()
    assert len(cleared) >= 2  # after each of the step's two micro-batches (and where the stock loop clears it)


def test_auto_plans_for_the_run_length(tmp_path, monkeypatch):
    """strategy="auto" asks the planner for this device at TRL's max_length (rows joined when
    padding-free), else the model's max_position_embeddings; it refuses without either."""
    asked = []

    def planner(config, seq_len, device, **kwargs):
        asked.append((seq_len, kwargs["batch"], kwargs["optimizer"], device.type))
        return lt.Strategy(checkpoint=True, mst=True)

    monkeypatch.setattr("longtrain.plan.auto.auto_strategy", planner)
    trainer = tiny_trainer(tmp_path, strategy="auto", args=training_args(tmp_path, per_device_train_batch_size=2))
    assert trainer.strategy == lt.Strategy.parse("checkpoint,mst") and asked[-1] == (16384, 2, "sgd", "cpu")
    args = training_args(tmp_path, per_device_train_batch_size=2, optim="adamw_torch")
    args.max_length = 512  # as TRL's SFTConfig has it
    tiny_trainer(tmp_path, strategy="auto", args=args)
    assert asked[-1] == (512, 2, "adamw", "cpu")
    _, bf16 = stock_and_ours("tiny-llama", dtype=torch.bfloat16)  # the Trainer's AdamW: moments in bfloat16
    tiny_trainer(tmp_path, bf16, strategy="auto", args=args)
    assert asked[-1] == (512, 2, "adamw-16bit", "cpu")
    _, ours = stock_and_ours("tiny-llama")
    ours.config.max_position_embeddings = 0
    with pytest.raises(lt.LongtrainError, match="set max_length"):
        tiny_trainer(tmp_path, ours, strategy="auto")
    _, lora = stock_lora_and_ours("tiny-llama")
    with pytest.raises(lt.LongtrainError, match="longtrain plan --lora"):
        tiny_trainer(tmp_path, lora, strategy="auto")


def test_imports_stay_light():
    """`import longtrain` loads neither TRL, datasets nor accelerate (nor does its strategy
    module load TRL or datasets: accelerate comes with transformers' model code); longtrain.hf
    works without TRL."""
    script = ("import sys; sys.modules['trl'] = None\n"  # TRL not installed
              "loaded = lambda *names: [m for m in names if sys.modules.get(m)]\n"
              "import longtrain\n"
              "assert not loaded('trl', 'datasets', 'accelerate')\n"
              "import longtrain.strategy\n"
              "assert not loaded('trl', 'datasets')\n"
              "from longtrain.hf import LongtrainTrainer, wrap\n"
              "print('ok')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# ---- TRL --------------------------------------------------------------------------------

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None,
                               reason="TRL and datasets are not installed (pip install trl datasets accelerate)")

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
                 "{{ m['content'] }}<eos>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer():
    """A byte-level tokenizer built here (no files, no downloads) with a chat template whose
    assistant turns are marked for assistant_only_loss."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


class Float64LogProb(torch.autograd.Function):
    """Stands in for TRL's fused LM head kernel, which computes in float32: the same per-token
    outputs (log-probability of the target, entropy, top-1) from full logits in float64."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        logits = F.linear(hidden, weight, bias) * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
        target = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1) if "entropy" in outputs else None
        top1 = (logits.argmax(-1) == targets) if "is_top1" in outputs else None
        return target, entropy, None, None, top1


def sft_data(conversational: bool):
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    words = ["alpha", "beta", "gamma", "delta", "long", "context", "exact", "gradient", "train", "chunk"]

    def text(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    pairs = [(text(2 + i % 3), text(3 + (i * 5) % 4)) for i in range(8)]
    if conversational:
        return Dataset.from_list([{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                                  for p, c in pairs])
    return Dataset.from_list([{"prompt": p, "completion": c} for p, c in pairs])


SFT_CASES = {
    # Prompt-completion records packed padding-free (TRL's BFD: one row, restarting positions),
    # loss on completions only; plain autograd.
    "packed-completion-only": dict(conversational=False, strategy=None,
                                   config=dict(packing=True, max_length=64, per_device_train_batch_size=1,
                                               gradient_checkpointing=False)),
    # Chat records padded, loss on assistant turns only; TRL's default activation
    # checkpointing becomes longtrain's checkpoint beside mst.
    "padded-assistant-only": dict(conversational=True, strategy="mst:loss_chunks=3",
                                  config=dict(assistant_only_loss=True, per_device_train_batch_size=2)),
    # The chunked engines: TRL's metrics from each chunk's head call (SeCO's loss-only first
    # pass not counted twice).
    "packed-fpdt": dict(conversational=False, strategy="fpdt:chunk=16,mst",
                        config=dict(packing=True, max_length=64, per_device_train_batch_size=1,
                                    gradient_checkpointing=False)),
    "padded-seco": dict(conversational=True, strategy="seco:chunk=16",
                        config=dict(assistant_only_loss=True, per_device_train_batch_size=2,
                                    gradient_checkpointing=False)),
}


@needs_trl
@pytest.mark.parametrize("case", SFT_CASES)
def test_sft_trainer_step_equals_stock(case, tmp_path, monkeypatch):
    from trl import SFTConfig, SFTTrainer

    monkeypatch.setattr("trl.trainer.utils._ChunkedLogProbFunction", Float64LogProb, raising=False)
    spec = SFT_CASES[case]
    stock, ours = stock_and_ours("tiny-llama")
    before = {n: p.detach().clone() for n, p in stock.named_parameters()}
    results = []
    for model, cls, kwargs in ((stock, SFTTrainer, {}), (ours, wrap(SFTTrainer), {"strategy": spec["strategy"]})):
        in_float64(model)  # where TRL leaves the loss to the model
        args = SFTConfig(output_dir=str(tmp_path / cls.__name__), use_cpu=True, bf16=False, report_to="none",
                         disable_tqdm=True, gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=0.5,
                         lr_scheduler_type="constant", logging_steps=1, save_strategy="no", seed=0,
                         dataset_num_proc=None, **spec["config"])
        trainer = cls(model=model, args=args, train_dataset=sft_data(spec["conversational"]),
                      processing_class=byte_tokenizer(), **kwargs)
        params, losses = train(trainer)
        results.append((params, losses, trainer))
    (stock_params, stock_losses, _), (params, losses, trainer) = results
    assert max_rel(params, stock_params, before) <= 1e-10
    assert len(losses) == 2 and all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, stock_losses))
    logged, stock_logged = trainer.state.log_history[0], results[0][2].state.log_history[0]
    for metric in ("entropy", "mean_token_accuracy", "num_tokens"):  # TRL's, computed by the step's LM head
        assert logged[metric] == pytest.approx(stock_logged[metric], rel=1e-10), metric
    if case == "padded-assistant-only":
        assert trainer.strategy == lt.Strategy.parse("checkpoint,mst:loss_chunks=3")
        assert not trainer.args.activation_checkpointing


@needs_trl
def test_sft_example_runs(tmp_path, monkeypatch):
    """examples/sft_trl.py, run as it is (in this process: its imports are loaded already)."""
    monkeypatch.chdir(tmp_path)  # its output directory lands here
    trainer = runpy.run_path(str(REPO / "examples" / "sft_trl.py"), run_name="__main__")["trainer"]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.strategy == lt.Strategy.parse("fpdt:chunk=64,mst") and losses[-1] < losses[0] - 1  # it learns


def test_doc_shows_the_example():
    """docs/hf.md shows examples/sft_trl.py as it is, and its first commands install from this
    repository (there is no package on the index) and run that example, which
    test_sft_example_runs runs."""
    doc = (REPO / "docs" / "hf.md").read_text()
    assert f"```python\n{(REPO / 'examples' / 'sft_trl.py').read_text()}```" in doc
    first = doc.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first[0].startswith("make install && .venv/bin/pip install -e '.[hf]'")
    assert first[1].startswith(".venv/bin/python examples/sft_trl.py")
    assert "pip install 'longtrain" not in doc


def test_evaluation_adds_long_context_accuracies(tmp_path):
    """long_context_eval: the Trainer's evaluation logs the pass-key and needle accuracies
    (what `longtrain eval` measures) beside its own metrics."""
    from longtrain.train.tokenizer import ByteTokenizer

    data = Batches(MICRO_BATCHES)
    _, ours = stock_and_ours("tiny-llama")
    settings = {"lengths": [256], "depths": [0.0, 1.0], "samples": 2, "task": "both"}
    trainer = LongtrainTrainer(model=ours, args=training_args(tmp_path), train_dataset=data, eval_dataset=data,
                               data_collator=data.collate, processing_class=ByteTokenizer(), long_context_eval=settings)
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_passkey_256", "eval_needle_256_d0.00", "eval_needle_256_d1.00"} <= set(metrics)
    assert all(0 <= metrics[k] <= 1 for k in metrics if "passkey" in k or "needle" in k)
    assert any("eval_passkey_256" in entry for entry in trainer.state.log_history)
    with pytest.raises(lt.LongtrainError, match="long_context_eval takes a mapping with 'lengths'"):
        LongtrainTrainer(model=ours, args=training_args(tmp_path), train_dataset=data, long_context_eval={"depth": [0]})


def test_long_context_eval_beyond_the_models_positions_is_refused_unless_asked(tmp_path, caplog):
    """As `longtrain eval` refuses `--lengths` past max_position_embeddings (without
    `--extend-context`), the Trainer refuses such long_context_eval lengths when it is built,
    and says what each evaluation will cost."""
    import logging

    model = stock_and_ours("tiny-llama")[1]
    limit = model.config.max_position_embeddings
    with pytest.raises(lt.LongtrainError) as refused:
        tiny_trainer(tmp_path, model=model, long_context_eval={"lengths": [256, 2 * limit]})
    assert "\n" not in str(refused.value) and "extend_context=True" in str(refused.value)
    with caplog.at_level(logging.INFO, logger="longtrain.hf"):
        tiny_trainer(tmp_path, model=model, long_context_eval={"lengths": [256, 2 * limit], "extend_context": True,
                                                               "depths": [0.5], "samples": 3})
    assert f"4 long-context cells of 3 samples: 12 forward passes of up to {2 * limit:,} tokens" in caplog.text


def moe_stock_and_ours():
    """A tiny Qwen3-MoE with its load-balancing loss on (coefficient 0.02), experts one by one."""
    from longtrain.families import tiny_config

    config = tiny_config("qwen3_moe")
    config.output_router_logits, config.router_aux_loss_coef = True, 0.02
    config._experts_implementation = "eager"
    return stock_and_ours(config)


@pytest.mark.parametrize("mean", [False, True])
def test_a_mixture_of_experts_balancing_loss_trains_as_the_stock_trainer(mean, tmp_path):
    """The Trainer adds the model's own loss, LM + coef · aux, per micro-batch (divided by
    the accumulation steps where it counts no num_items_in_batch): one optimizer step equals
    stock's, float64 throughout (the stock balancing loss sums in float32 otherwise)."""
    from longtrain.families import float64_throughout

    stock, ours = moe_stock_and_ours()
    before = {n: p.detach().clone() for n, p in stock.named_parameters()}
    results = []
    with float64_throughout():
        for model, kwargs in ((stock, {}), (ours, {"strategy": "fpdt:chunk=16,mst"})):
            data = Batches(MICRO_BATCHES)
            cls = Trainer if not kwargs else LongtrainTrainer
            trainer = cls(model=in_float64(model), args=training_args(tmp_path / str(len(results))), train_dataset=data,
                          data_collator=data.collate, **kwargs)
            results.append(train(trainer, mean))
    (stock_params, stock_losses), (params, losses) = results
    assert max_rel(params, stock_params, before) <= 1e-10
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, stock_losses))


def test_a_micro_batch_without_labels_still_trains_the_balancing_loss(tmp_path):
    """A micro-batch with no label token: its language-model loss is 0, but the stock Trainer
    still adds coef · aux and trains the routers with it; so does longtrain's step."""
    from longtrain.families import float64_throughout

    stock, ours = moe_stock_and_ours()
    before = {n: p.detach().clone() for n, p in stock.named_parameters()}
    unlabelled = dict(MICRO_BATCHES[1], labels=torch.full_like(MICRO_BATCHES[1]["labels"], -100))
    results = []
    with float64_throughout():
        for model, cls, kwargs in ((stock, Trainer, {}), (ours, LongtrainTrainer, {"strategy": "checkpoint,mst"})):
            data = Batches([MICRO_BATCHES[0], unlabelled])
            trainer = cls(model=in_float64(model), args=training_args(tmp_path / cls.__name__), train_dataset=data,
                          data_collator=data.collate, **kwargs)
            results.append(train(trainer))
    (stock_params, stock_losses), (params, losses) = results
    assert max_rel(params, stock_params, before) <= 1e-10
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, stock_losses)) and min(losses) > 0


@needs_trl
def test_a_mixture_of_experts_balancing_loss_trains_as_stock_trl(tmp_path, monkeypatch):
    """TRL's SFTTrainer averages coef · aux over the accumulation steps and logs aux_loss;
    wrap(SFTTrainer) does the same: one optimizer step equals stock's."""
    from trl import SFTConfig, SFTTrainer

    from longtrain.families import float64_throughout

    monkeypatch.setattr("trl.trainer.utils._ChunkedLogProbFunction", Float64LogProb, raising=False)
    stock, ours = moe_stock_and_ours()
    before = {n: p.detach().clone() for n, p in stock.named_parameters()}
    results = []
    with float64_throughout():
        for model, cls, kwargs in ((stock, SFTTrainer, {}), (ours, wrap(SFTTrainer), {"strategy": "seco:chunk=16,mst"})):
            in_float64(model)
            args = SFTConfig(output_dir=str(tmp_path / cls.__name__), use_cpu=True, bf16=False, report_to="none",
                             disable_tqdm=True, gradient_accumulation_steps=2, max_steps=1, optim="sgd",
                             learning_rate=0.5, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             seed=0, dataset_num_proc=None, packing=True, max_length=64, per_device_train_batch_size=1,
                             activation_checkpointing=False)
            trainer = cls(model=model, args=args, train_dataset=sft_data(False), processing_class=byte_tokenizer(),
                          **kwargs)
            params, losses = train(trainer)
            results.append((params, losses, trainer.state.log_history[0]))
    (stock_params, stock_losses, stock_log), (params, losses, log) = results
    assert max_rel(params, stock_params, before) <= 1e-10
    assert all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, stock_losses))
    assert log["aux_loss"] == pytest.approx(stock_log["aux_loss"], rel=1e-10)
