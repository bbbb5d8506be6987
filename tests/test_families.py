"""Model families: every family longtrain supports is float64-exact under every engine and
technique (tiny, two layers, on right-padded, left-padded and packed batches), the
generated table says what the code supports, model facts come from the adapters alone,
and a mixture of experts costs its active experts' FLOPs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import longtrain as lt
from longtrain.errors import LongtrainError
from longtrain.families import FD_TOLERANCE, STRATEGIES, TOLERANCE, check_family, tiny_config
from longtrain.models.adapters import adapter_class, describe_model, supported_families
from longtrain.models.flops import active_matmul_parameters
from longtrain.models.loading import build_from_config
from longtrain.models.presets import preset_config

ROOT = Path(__file__).resolve().parent.parent
SSMS = {f for f in supported_families() if not adapter_class(f).has_attention}
TRANSFORMER_FAMILIES = [f for f in supported_families() if f not in SSMS]
# What may be refused, and why: nothing else.
ALLOWED_REFUSALS = {"memo": "a mixture of experts saves its activations in groups of tokens"}


@pytest.mark.parametrize("family", TRANSFORMER_FAMILIES)
def test_every_supported_family_is_exact_under_every_engine_and_technique(family):
    """The family check (longtrain.families): every strategy equals stock on five batches
    (a mixture of experts with its balancing loss on), and with every dropout on its
    gradient is the derivative of the loss it reports. Here (every family, strategy and
    batch in `longtrain families`, which writes docs/results/families.md) each family runs every
    strategy on the right-padded and one-tile batches and, in turn, the left-padded, the
    packed or the one-row one, and the dropout pass on a quarter of the strategies in turn; a
    post-norm family, one with embedding dropout and every mixture of experts (one with
    router jitter) run every batch, and the first three every dropout-pass strategy too."""
    index = TRANSFORMER_FAMILIES.index(family)
    everything = family in ("olmo2", "starcoder2", "mixtral")
    chosen = STRATEGIES if everything else STRATEGIES[index % 4::4]
    batches = None if everything or describe_model(tiny_config(family)).is_moe else \
        ("right-padded", "one tile", ("left-padded", "packed", "one row")[index % 3])
    result = check_family(family, dropout_strategies=chosen, batches=batches)
    assert result.dropout_tolerance == FD_TOLERANCE or family == "bitnet", result.dropout_tolerance
    assert result.adapter is not None
    for strategy in STRATEGIES:
        checked = ((result.cells[strategy], TOLERANCE),) + \
            (((result.dropout[strategy], result.dropout_tolerance),) if strategy in result.dropout else ())
        assert strategy in result.dropout or strategy not in chosen
        for cell, tolerance in checked:
            if isinstance(cell, str):
                assert strategy in ALLOWED_REFUSALS and ALLOWED_REFUSALS[strategy] in cell, (strategy, cell)
            else:
                assert cell <= tolerance, (strategy, cell)
    assert result.status == "exact", result


def test_at_least_twenty_families_beyond_the_first_eight_include_the_ones_people_train():
    first = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "granite", "cohere"}
    wanted = {"gemma3_text", "qwen3_moe", "qwen2_moe", "mixtral", "olmo2", "smollm3", "glm4"}
    assert wanted <= set(TRANSFORMER_FAMILIES)
    assert len(set(TRANSFORMER_FAMILIES) - first) >= 20


def test_the_generated_table_lists_exactly_the_supported_families():
    text = (ROOT / "docs" / "results" / "families.md").read_text()
    supported = text.split("## Supported", 1)[1].split("## Not supported", 1)[0]
    listed = set(re.findall(r"^\| `([^`]+)` \| exact \|", supported, flags=re.M))
    assert listed == set(TRANSFORMER_FAMILIES)
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{family}`" in readme for family in TRANSFORMER_FAMILIES)


def test_a_family_without_an_adapter_is_refused_in_one_line():
    config = tiny_config("gpt_neox")
    model = build_from_config(config, torch.float32)
    with pytest.raises(LongtrainError, match=r"^longtrain does not support gpt_neox models; supported model families: "):
        lt.apply(model, "checkpoint")


MOE_FAMILIES = [f for f in TRANSFORMER_FAMILIES if describe_model(tiny_config(f)).is_moe]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_mixture_of_experts_under_mst_on_one_tile_equals_stock(family):
    """16 tokens under plain ``mst``: the MLP's tile (the hidden size) holds the whole input,
    which the block runs as the model would, with its load-balancing loss on."""
    from conftest import check_step, stock_and_ours

    from longtrain.families import float64_throughout
    from longtrain.families.check import _stock_loss

    config = tiny_config(family)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.02
    config._experts_implementation = "eager"
    stock, ours = stock_and_ours(config)
    ids = torch.randint(3, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with float64_throughout():
        check_step(stock, ours, "mst", {"input_ids": ids, "labels": ids}, reference=_stock_loss)


def test_the_load_balancing_loss_switched_on_after_apply_is_added_at_the_next_step():
    """The config is read at each step, as the stock forward reads it: switched on after
    ``apply``, the step reports LM + coef · aux with stock's gradients; lt.router_aux_loss
    says what it added; switched off again, neither."""
    from conftest import check_step, padded_batch, stock_and_ours

    from longtrain.families import float64_throughout
    from longtrain.families.check import _stock_loss

    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"
    stock, ours = stock_and_ours(config)
    lt.apply(ours, "fpdt:chunk=16,mst")
    assert lt.router_aux_loss(ours) is None
    for model in (stock, ours):
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.02
    batch = padded_batch(config.vocab_size, lengths=(37, 29))
    with float64_throughout():
        check_step(stock, ours, "fpdt:chunk=16,mst", batch, reference=_stock_loss)
        aux = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).aux_loss
    assert abs(float(lt.router_aux_loss(ours)) - float(aux.detach())) <= 1e-12
    ours.config.output_router_logits = False
    lt.step(ours, batch)
    assert lt.router_aux_loss(ours) is None


@pytest.mark.parametrize("strategy", ["checkpoint,mst", "fpdt:chunk=16,mst", "seco:chunk=16,checkpoint,mst"])
def test_the_balancing_loss_is_exact_with_backward_on_another_thread(strategy):
    """On CUDA autograd runs the backward on its own thread: the routers' token rows (a
    thread-local context) must reach the tiled MLP's and the recomputed layers' backward there."""
    from conftest import check_step, padded_batch, stock_and_ours

    from longtrain.families import float64_throughout
    from longtrain.families.check import _stock_loss

    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"
    config.output_router_logits, config.router_aux_loss_coef = True, 0.02
    stock, ours = stock_and_ours(config)
    with float64_throughout():
        check_step(stock, ours, strategy, padded_batch(config.vocab_size, lengths=(37, 29)), another_thread=True,
                   reference=_stock_loss)


def test_a_failed_step_leaves_no_balancing_counts_behind():
    """A step that fails after its forward pass began drops the routes it counted: the next
    step equals stock, and no stale counts wait for another forward."""
    from conftest import check_step, padded_batch, stock_and_ours

    from longtrain.families import float64_throughout
    from longtrain.families.check import _stock_loss
    from longtrain.strategy import applied_context

    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"
    config.output_router_logits, config.router_aux_loss_coef = True, 0.02
    stock, ours = stock_and_ours(config)
    lt.apply(ours, "checkpoint,mst")
    batch = padded_batch(config.vocab_size, lengths=(37, 29))
    norm = ours.model.norm.forward  # after every router has counted its tokens
    ours.model.norm.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        lt.step(ours, batch)
    assert applied_context(ours).router_balance.ledger is None
    ours.model.norm.forward = norm
    ours.zero_grad(set_to_none=True)
    with float64_throughout():
        check_step(stock, ours, "checkpoint,mst", batch, reference=_stock_loss)


def test_a_balancing_loss_longtrain_cannot_add_is_refused_in_one_line(monkeypatch):
    from longtrain.models.adapters.base import DecoderAdapter

    config = tiny_config("qwen3_moe")
    config.output_router_logits, config.router_aux_loss_coef = True, 0.02
    model = build_from_config(config, torch.float32)
    monkeypatch.setattr(DecoderAdapter, "routers", lambda self: [])
    with pytest.raises(LongtrainError, match=r"asks for its routers' load-balancing loss .* set output_router_logits=False"):
        lt.apply(model, "checkpoint")
    model.config.output_router_logits = False
    lt.apply(model, "checkpoint")


@pytest.mark.parametrize("family", ["gemma3_text", "gemma2", "gemma"])
def test_bidirectional_attention_is_refused_in_one_line(family):
    config = tiny_config(family)
    if not hasattr(config, "use_bidirectional_attention"):
        pytest.skip(f"{family} has no bidirectional flag in this transformers")
    config.use_bidirectional_attention = True
    model = build_from_config(config, torch.float32)
    with pytest.raises(LongtrainError, match=r"attention is bidirectional \(use_bidirectional_attention=True\); .* "
                                             "set use_bidirectional_attention=False"):
        lt.apply(model, "checkpoint")


def test_starcoder2_draws_its_embedding_dropout_as_stock_does():
    """StarCoder2's ``embedding_dropout``: the reported loss depends on the seed, and under
    backprop (which draws in stock's order) equals stock's with the same seed."""
    from conftest import check_step, padded_batch, stock_and_ours

    from longtrain.families import float64_throughout

    config = tiny_config("starcoder2")
    config.embedding_dropout = 0.3
    stock, ours = stock_and_ours(config)
    batch = padded_batch(config.vocab_size, lengths=(37, 29))
    with float64_throughout():
        torch.manual_seed(4)
        check_step(stock, ours, "none", batch, seed=4)
        first = float(lt.step(ours, batch))
        torch.manual_seed(5)
        assert float(lt.step(ours, batch)) != first


def test_neftune_under_a_chunked_engine_is_refused_in_one_line():
    """NEFTune's noise is scaled by the length of the sequence the embedding sees; chunked
    engines embed chunk by chunk: refused before anything runs."""
    model = build_from_config(tiny_config("llama"), torch.float32)
    lt.apply(model, "fpdt:chunk=16")
    model.get_input_embeddings().neftune_noise_alpha = 5.0
    ids = torch.randint(3, 300, (1, 40))
    with pytest.raises(LongtrainError, match=r"^NEFTune \(neftune_noise_alpha\) .* the fpdt engine embeds chunk by chunk; "
                                             "train with backprop"):
        lt.step(model, {"input_ids": ids})


@pytest.mark.parametrize("family", TRANSFORMER_FAMILIES)
def test_the_description_counts_the_layers_weights_as_built(family):
    """Per layer: attention projections and the feed-forward block's matrices (every
    expert, the router, shared experts) as the model holds them; not biases (gpt-oss's
    experts hold theirs as (experts, width) tensors)."""
    config = tiny_config(family)
    model = build_from_config(config, torch.float32)
    shape = describe_model(config)
    layer = model.model.layers[0]
    held = sum(p.numel() for name, p in layer.named_parameters() if p.dim() >= 2 and not name.endswith("bias"))
    described = shape.attention_parameters + shape.feed_forward[0].parameters(shape.hidden)
    assert held == described
    assert shape.layers == len(model.model.layers)


def test_a_mixture_of_experts_counts_the_flops_of_its_active_experts():
    """The forward's matmul FLOPs, counted by PyTorch on the model (experts one by one),
    are 2 per active parameter and token, not per parameter held."""
    from longtrain.models.flops import count_flops

    config = tiny_config("qwen3_moe")
    model = build_from_config(config, torch.float64)
    shape = describe_model(config)
    tokens = 29
    ids = torch.randint(3, config.vocab_size, (1, tokens))
    counted, _ = count_flops(lambda: model(input_ids=ids))
    attention = 4 * shape.layers * shape.attention_width * tokens * tokens  # QKᵀ and PV (2 each), the full square counted
    active = shape.matmul_parameters(active_only=True)
    assert counted - attention == 2 * tokens * active
    assert active_matmul_parameters(model) == active < shape.matmul_parameters(active_only=False)


def test_simulate_reports_the_flops_of_the_active_experts():
    report = lt.simulate("tiny-qwen3-moe", 256, strategy="checkpoint,mst", lora_rank=4, optimizer="none")
    shape = describe_model(preset_config("tiny-qwen3-moe"))
    assert report.active_parameters == shape.matmul_parameters(True) < report.matmul_parameters
    assert report.flops_per_token == 6 * report.active_parameters + 6 * shape.layers * shape.attention_width * 256
    assert "the experts a token runs" in report.table()


def test_no_model_fact_is_read_from_a_config_outside_the_adapters():
    """Engines, techniques, the planner and the trainer ask the model's description; only
    adapters read config fields (presets and the family check build configs; the
    SSM-ResNet is a model definition)."""
    fields = ("num_hidden_layers|hidden_size|intermediate_size|moe_intermediate_size|num_attention_heads|"
              "num_key_value_heads|head_dim|vocab_size|sliding_window|use_sliding_window|layer_types|"
              "partial_rotary_factor|max_position_embeddings|num_experts|num_local_experts|num_experts_per_tok|"
              "tie_word_embeddings|rope_parameters|attention_chunk_size")
    pattern = re.compile(rf"config\.({fields})\b|getattr\([\w.]*config\w*, \"({fields})\"")
    allowed = {"models/presets.py", "models/ssm_resnet.py", "families/cases.py"}
    found = []
    for path in sorted((ROOT / "src" / "longtrain").rglob("*.py")):
        relative = path.relative_to(ROOT / "src" / "longtrain").as_posix()
        if relative.startswith("models/adapters/") or relative in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_gemma3_sliding_layers_skip_the_chunks_their_window_cannot_see():
    """Gemma-3: two sliding layers (24 tokens) and a global one, each with its own rotary
    table. Over 16-token chunks, a sliding layer's queries attend to one or two chunks, not
    to every earlier one: fewer attention kernel calls than the same model with global
    layers only, and the step stays exact."""
    from conftest import AttentionKernelCalls, check_step, padded_batch, stock_and_ours

    from longtrain.families import float64_throughout

    def calls(layer_types):
        config = preset_config("tiny-gemma3")
        config.layer_types = layer_types
        stock, ours = stock_and_ours(config)
        batch = padded_batch(320, lengths=(150, 131))
        strategy = lt.Strategy(engine="fpdt", engine_options={"chunk": 16, "offload": True})
        with float64_throughout(), AttentionKernelCalls() as counter:
            check_step(stock, ours, strategy, batch)
        return sum(counter.calls.values())

    assert calls(["sliding_attention", "sliding_attention", "full_attention"]) < calls(["full_attention"] * 3)


def test_the_families_command_checks_named_families_and_refuses_unknown_ones(tmp_path):
    from conftest import cli

    code, out, err = cli("families", "no_such_family", "--out", str(tmp_path / "f.md"))
    assert code == 2 and "not a decoder-only causal-LM family" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli("families", "olmo", "--out", str(tmp_path / "f.md"))
    assert code == 0, err
    text = (tmp_path / "f.md").read_text()
    assert "| `olmo` | exact |" in text and "longtrain families olmo --out" in text


def test_the_simulator_counts_what_the_balancing_loss_keeps():
    """Simulations run the step's own code: with the balancing loss on, each router call's
    logits are kept for its backward (N × E), a little more than without."""
    from longtrain.models.presets import preset_config

    peaks = []
    for on in (False, True):
        config = preset_config("tiny-qwen3-moe")
        config.output_router_logits, config.router_aux_loss_coef = on, 0.02
        peaks.append(lt.simulate(config, 512, strategy="fpdt:chunk=128,mst", optimizer="none").peak.peak_device_bytes)
    assert peaks[0] < peaks[1] < peaks[0] * 1.01
