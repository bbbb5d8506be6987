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
from longtrain.families import STRATEGIES, check_family, tiny_config
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
    result = check_family(family)
    assert result.adapter is not None
    for strategy in STRATEGIES:
        cell = result.cells[strategy]
        if isinstance(cell, str):
            assert strategy in ALLOWED_REFUSALS and ALLOWED_REFUSALS[strategy] in cell, (strategy, cell)
        else:
            assert cell <= 1e-10, (strategy, cell)
    assert result.status == "exact", result


def test_at_least_twenty_families_beyond_the_first_eight_include_the_ones_people_train():
    first = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "granite", "cohere"}
    wanted = {"gemma3_text", "qwen3_moe", "qwen2_moe", "mixtral", "olmo2", "smollm3", "glm4"}
    assert wanted <= set(TRANSFORMER_FAMILIES)
    assert len(set(TRANSFORMER_FAMILIES) - first) >= 20


def test_the_generated_table_lists_exactly_the_supported_families():
    text = (ROOT / "docs" / "families.md").read_text()
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


def test_the_router_load_balancing_loss_is_refused_in_one_line():
    config = tiny_config("qwen3_moe")
    config.output_router_logits, config.router_aux_loss_coef = True, 0.01
    model = build_from_config(config, torch.float32)
    with pytest.raises(LongtrainError, match="load-balancing loss .* set output_router_logits=False"):
        lt.apply(model, "checkpoint")


@pytest.mark.parametrize("family", TRANSFORMER_FAMILIES)
def test_the_description_counts_the_layers_weights_as_built(family):
    """Per layer: attention projections and the feed-forward block's matrices (every
    expert, the router, shared experts) as the model holds them."""
    config = tiny_config(family)
    model = build_from_config(config, torch.float32)
    shape = describe_model(config)
    layer = model.model.layers[0]
    held = sum(p.numel() for p in layer.parameters() if p.dim() >= 2)
    described = shape.attention_parameters + shape.feed_forward[0].parameters(shape.hidden)
    assert held == described
    assert shape.layers == len(model.model.layers)


def test_a_mixture_of_experts_counts_the_flops_of_its_active_experts():
    """The forward's matmul FLOPs, counted by PyTorch on the model (experts one by one),
    are 2 per active parameter and token, not per parameter held."""
    from longtrain.memory.flops import count_flops

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
    allowed = {"models/presets.py", "models/ssm_resnet.py", "families.py"}
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
