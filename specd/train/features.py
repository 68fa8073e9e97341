"""What a frozen target gives its drafters' training: hidden states and next-token distributions.

The rows match what specd's runner sends a drafter at inference (specd.models.llama): `aux` is the
residual stream entering each of EAGLE-3's layers (transformers' hidden_states[i]) concatenated,
`final` the last hidden state after the final norm (DeepSeek MTP's input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from specd.train.target import autocast


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, T, 3H]
    final: torch.Tensor  # [B, T, H]
    logits: torch.Tensor  # [B, T, V] float32


@torch.no_grad()
def target_features(target: LlamaForCausalLM, ids: torch.Tensor, aux_layer_ids: list[int]
                    ) -> TargetFeatures:
    with autocast(ids.device):
        out = target(input_ids=ids, output_hidden_states=True)
    states = out.hidden_states  # L + 1 entries; [-1] is after the final norm
    aux = torch.cat([states[i] for i in aux_layer_ids], dim=-1)
    return TargetFeatures(aux=aux.float(), final=states[-1].float(), logits=out.logits.float())


@torch.no_grad()
def greedy_continuations(target: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int
                         ) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new_tokens]: the target's own greedy text, for self-distillation.

    Drafters are served on the target's outputs, not on the corpus; training partly on them is
    what EAGLE and Medusa do ("regenerated data"). Generation runs past EOS on purpose: the
    stream-style data then matches the corpus windows.
    """
    target.eval()
    with autocast(prompts.device):
        out = target(input_ids=prompts, use_cache=True)
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(new_tokens - 1):
            out = target(input_ids=tokens[-1][:, None], past_key_values=out.past_key_values,
                         use_cache=True)
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)
