"""Fine-tune with TRL's SFTTrainer, each step run by a longtrain strategy; a CPU does it in seconds.

    make install && .venv/bin/pip install -e '.[hf]' && .venv/bin/python examples/sft_trl.py   # in this repository
    .venv/bin/torchrun --nproc-per-node 2 examples/sft_trl.py              # data parallel (gloo on a CPU)
    SP_SIZE=2 .venv/bin/torchrun --nproc-per-node 4 examples/sft_trl.py    # GPUs: 2 groups of 2 sharing each sequence

A real run loads its model and tokenizer with from_pretrained and sets max_length to its
context (32768, ...); here both are tiny and built offline: a byte-level tokenizer and a
two-layer Llama with random weights, learning to answer with the colour of a fruit.
"""

import os

from accelerate import ParallelismConfig
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, set_seed
from trl import SFTConfig, SFTTrainer

from longtrain.hf import wrap

set_seed(0)
byte_level = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
byte_level.pre_tokenizer, byte_level.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level, eos_token="<eos>", pad_token="<pad>")
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))

fruit = {"banana": "yellow", "cherry": "red", "lime": "green", "plum": "purple", "orange": "orange"}
data = Dataset.from_list([{"prompt": f"The colour of a {name} is", "completion": f" {colour}."}  # loss on completions only
                          for name, colour in fruit.items()] * 8)

args = SFTConfig(output_dir="runs/sft-trl-example", max_steps=20, learning_rate=5e-3, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2, packing=True, max_length=128,  # packed rows, positions restart per record
                 bf16=False, logging_steps=5, save_strategy="no", report_to="none",
                 # processes sharing each sequence (longtrain's Ulysses; Accelerate takes it on GPUs)
                 parallelism_config=ParallelismConfig(sp_size=int(os.environ["SP_SIZE"])) if "SP_SIZE" in os.environ else None)
trainer = wrap(SFTTrainer)(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                           strategy="fpdt:chunk=64,mst")  # or "checkpoint,mst", "memo:alpha=0.3,mst", "auto"
trainer.train()
print(f"strategy {trainer.strategy.name}; final training loss {trainer.state.log_history[-2]['loss']:.3f}")
