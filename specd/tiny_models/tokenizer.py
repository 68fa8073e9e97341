"""A small byte-level BPE tokenizer trained on Python standard-library sources, with a chat template.

Every machine with Python has the corpus, so tiny checkpoints are reproducible anywhere without
downloads. Training is deterministic for a given corpus and vocabulary size.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]  # ids 0..3

# ChatML, as Qwen uses; the generation prompt opens the assistant turn. With tools, Qwen 2.5's
# Hermes-style tool section and `<tool_call>` turns (services/gateway/tool_formats.py HERMES);
# without them every conversation renders as plain ChatML, the text the family was trained on.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, '"
    " + '\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}{% if not loop.first or message['content'] %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Modules that exist, little changed, in every CPython 3.10+: the corpus stays the same across machines.
CORPUS_MODULES = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "functools.py",
                  "json/__init__.py", "json/decoder.py", "json/encoder.py", "colorsys.py", "keyword.py"]


def corpus_texts(modules: list[str] = CORPUS_MODULES) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / m).read_text(encoding="utf-8") for m in modules if (stdlib / m).exists()]
    if not texts:
        raise RuntimeError(f"no standard-library sources found under {stdlib}")
    return texts


def train_tokenizer(vocab_size: int = 512, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer; special tokens take ids 0..3."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts if texts is not None else corpus_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tokenizer(out_dir: str | Path, tokenizer: PreTrainedTokenizerFast) -> None:
    tokenizer.save_pretrained(str(out_dir))
