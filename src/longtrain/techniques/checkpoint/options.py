"""``checkpoint``'s options: which layers are checkpointed and where their kept attention
outputs and parked inputs wait (validated when built)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import validate
from ...errors import LongtrainError
from ...models.adapters import describe_model
from ...models.shapes import kept_output_bytes


@dataclass
class CheckpointOptions:
    """Knobs of layer checkpointing."""

    keep_attention: bool = True  # keep attention's output and LSE so the recomputation skips attention's forward
    offload: bool = True  # kept outputs wait in pinned host memory (false: on the device)
    host_memory: int | str | None = None  # budget for kept outputs on the host; default: the run's host memory (EngineContext)
    except_last: int = 0  # the top layers left whole: not checkpointed, MLP not tiled (device memory for speed)
    offload_inputs: bool = False  # park the checkpointed inputs in pinned host memory too (first in host_memory's budget)

    def __post_init__(self):
        validate.flag("checkpoint", "keep_attention", self.keep_attention)
        validate.flag("checkpoint", "offload_inputs", self.offload_inputs)
        validate.positive_int("checkpoint", "except_last", self.except_last, minimum=0)
        validate.flag("checkpoint", "offload", self.offload)
        if self.host_memory is not None:
            self.host_memory = validate.byte_size("checkpoint", "host_memory", self.host_memory)
            if self.host_memory <= 0:
                raise LongtrainError(f"checkpoint host_memory must be positive, got {self.host_memory!r}")

    def host_bytes_wanted(self, config, batch: int, tokens: int, item: int) -> int:
        """What the checkpointed layers of a step of ``batch`` × ``tokens`` tokens (``item``
        bytes per element) would put in host memory with no budget — each one's input
        (``offload_inputs``) and attention output + LSE (``keep_attention`` with ``offload``),
        at least what the step parks: where ``host_memory`` is this much or more it stops no layer."""
        shape = describe_model(config)
        layers = max(0, shape.layers - self.except_last)
        inputs = shape.layer_inputs_bytes(batch * tokens, item, layers) if self.offload_inputs else 0
        outputs = kept_output_bytes(config, batch, tokens, item) if self.keep_attention and self.offload else 0
        return inputs + layers * outputs
