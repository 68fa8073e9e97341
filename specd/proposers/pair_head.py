"""PairHeadProposer, the drafting loop of the heads that read target hidden states: EAGLE-3 and MTP.

Such a head pairs (h_p, x_{p+1}) at position p and predicts x_{p+2}. A sequence with committed
tokens x_0..x_n has committed pairs 0..n-1 (one target hidden row fewer than tokens, see
specd.proposers.base). Drafting k tokens is:
  catch-up    one forward over the committed pairs not yet in the head's KV cache; the output at
              pair n-1 gives draft d_1 (sequence position n+1);
  k-1 steps   pair (g, d_{j-1}) at position n+j-2, where g is the head's own output hidden state
              at the previous pair, gives d_j (sequence position n+j).
Catch-up entries are committed (they saw the target's hidden states) and stay in the cache; the
autoregressive entries are speculative and are cropped when the next committed tokens arrive.

The head's cache is paged, a block list per open sequence (head_kv.py): `BatchKV` gathers a
batch's cached entries side by side, padded to a common length, stores the new ones and gives the
mask that keeps sequences apart. On CUDA the forwards go through fixed shapes replayed as CUDA
graphs (head_graphs.py; `static_steps`), the eager path taking what does not fit them. A batch's
greedy sequences without a grammar keep their drafts on the device until the last step (one wait
a propose, not one a draft step); its sampled or constrained ones step on the host, apart.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specd.models.sdpa_backends import variable_shape_sdpa
from specd.models.weights import read_tensor, tensor_names
from specd.proposers.base import DraftProposal, DraftRequest
from specd.proposers.draft_constraints import mask_logits
from specd.proposers.head_graphs import MAX_STATIC_BATCH, HeadGraphs
from specd.proposers.head_kv import BLOCK, BatchKV, HeadKVCache
from specd.random import SALT_DRAFT
from specd.sampling import (SamplingTensors, apply_repetition_penalty, processed_probs,
                            sample_from_probs)
from specd.sampling_params import SamplingParams


class TransformersCache:
    """The cache transformers' attention modules call: `update(k, v, layer_idx)` -> all k, v."""

    def __init__(self, kv: BatchKV) -> None:
        self.kv = kv

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.kv.update(key_states, value_states)

    @staticmethod
    def kwarg_name(layer: nn.Module) -> str:
        """The keyword a transformers decoder layer takes its cache by: `cache` in the pinned
        release, `past_key_values` in older ones (a layer given neither would skip BatchKV)."""
        params = inspect.signature(layer.forward).parameters
        return "cache" if "cache" in params else "past_key_values"


def load_module_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Load checkpoint tensors (names relative to `module`) strictly, fusing per-expert MoE weights.

    Checkpoints store `mlp.experts.<e>.{gate,up,down}_proj.weight`; transformers' MoE modules hold
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I].
    """
    expected = module.state_dict()
    fused = dict(tensors)
    for name in expected:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")) or name in fused:
            continue
        base = name.rsplit(".", 1)[0]  # ...mlp.experts
        experts = range(expected[name].shape[0])

        def take(e: int, proj: str) -> torch.Tensor:
            return fused.pop(f"{base}.{e}.{proj}.weight")
        try:
            if name.endswith("gate_up_proj"):
                fused[name] = torch.stack(
                    [torch.cat([take(e, "gate_proj"), take(e, "up_proj")]) for e in experts])
            else:
                fused[name] = torch.stack([take(e, "down_proj") for e in experts])
        except KeyError as err:
            raise KeyError(f"{where}: missing expert weight {err}") from None
    missing = sorted(set(expected) - set(fused))
    unexpected = sorted(set(fused) - set(expected))
    if missing or unexpected:
        raise KeyError(f"{where}: checkpoint does not match the layer: missing {missing}, "
                       f"unexpected {unexpected}")
    module.load_state_dict(fused, strict=True)


def read_first_tensor(model_dir: str | Path, names: tuple[str, ...]) -> torch.Tensor:
    """The first of `names` the checkpoint holds (shared weights have several published names)."""
    available = set(tensor_names(model_dir))
    for name in names:
        if name in available:
            return read_tensor(model_dir, name)
    raise KeyError(f"checkpoint {model_dir} has none of {list(names)}")


@dataclass
class _SeqState:
    """Draft state of one sequence; pairs are counted by their position p."""

    params: SamplingParams
    tokens: list[int]  # committed x_0..x_n
    seq_id: int = -1
    pending: torch.Tensor | None = None  # [m, H] head-space hidden rows of pairs not yet cached
    slot: int = -1  # its handle in the proposer's HeadKVCache
    kv_len: int = 0  # positions it holds in the cache; past num_cached: speculative
    num_cached: int = 0  # committed pairs in the cache
    last: torch.Tensor | None = None  # [H] head output at the last committed pair

    @property
    def num_pairs(self) -> int:
        return self.num_cached + (0 if self.pending is None else self.pending.shape[0])


class PairHeadProposer:
    """Proposer around a head module with `project_target`, `forward` and `logits`.

    head.project_target(rows [n, H_target*]) -> [n, H]: the target rows in the head's input space.
    head.forward(ids [B, S], hidden [B, S, H], positions [B, S], kv: BatchKV) -> [B, S, H]: the
        hidden state fed back at the next position.
    head.logits(hidden [N, H]) -> [N, target_vocab] float32 (-inf outside the draft vocabulary).
    Options (the subclasses pass them on as **head_options): static_steps, the forwards through
    head_graphs.py's fixed shapes (CUDA graphs on CUDA), None: on CUDA, False on CUDA: the eager
    mode; max_batch_size, the largest batch those shapes take (larger ones run eagerly);
    kv_block_size, positions a block of the head's cache.
    """

    method: str
    hidden_kind: str

    def __init__(self, head: nn.Module, device: torch.device | str, dtype: torch.dtype,
                 static_steps: bool | None = None, max_batch_size: int = MAX_STATIC_BATCH,
                 kv_block_size: int = BLOCK) -> None:
        self.head = head.eval()
        self.device = torch.device(device)
        self.dtype = dtype
        self._seqs: dict[int, _SeqState] = {}
        # 16,384 positions of an 8B head's k and v: 64 MiB; each growth costs the graphs a recapture.
        positions = 16384 if self.device.type == "cuda" else 1024
        self._kv = HeadKVCache(self.device, initial_blocks=positions // kv_block_size, block_size=kv_block_size)
        static = self.device.type == "cuda" if static_steps is None else static_steps
        self.graphs = HeadGraphs(self.head, self._kv, dtype, max_batch_size=max_batch_size) if static else None
        self.draft_constraints = None  # DraftConstraints when structured output is enabled

    def open(self, seq_id: int, params: SamplingParams, grammar=None) -> None:
        old = self._seqs.get(seq_id)
        if old is not None:  # reopened (a resync): a fresh state; the old blocks go back
            self._kv.release(old.slot)
        self._seqs[seq_id] = _SeqState(params=params, tokens=[], seq_id=seq_id, slot=self._kv.acquire())
        if self.draft_constraints is not None:
            self.draft_constraints.open(seq_id, grammar)

    def close(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self._kv.release(state.slot)
        if self.draft_constraints is not None:
            self.draft_constraints.close(seq_id)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        # The head's keys grow by one every draft step: no cuDNN attention, which would build a
        # plan for each new length (~39 ms on an H100; specd/models/sdpa_backends.py).
        with variable_shape_sdpa():
            return self._propose(requests)

    def _propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        dc = self.draft_constraints
        projected = self._project([r.new_hidden_states for r in requests])
        for r, rows in zip(requests, projected):
            seq = self._seqs[r.seq_id]
            self._ingest(seq, r, rows)
            if dc is not None:
                dc.begin(r.seq_id, seq.tokens[len(seq.tokens) - r.num_output_tokens:])
        active = [r for r in requests if r.num_draft_tokens > 0]
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        probs: dict[int, list[torch.Tensor]] = {r.seq_id: [] for r in requests}
        if active:
            self._draft([self._seqs[r.seq_id] for r in active],
                        [r.num_draft_tokens for r in active],
                        [drafts[r.seq_id] for r in active], [probs[r.seq_id] for r in active])
        out = []
        # one tensor for the batch, split: a torch.tensor a request cost ~6 us each (0.7 ms at 128)
        lists = [drafts[r.seq_id] for r in requests]
        token_ids = torch.tensor([t for d in lists for t in d], dtype=torch.long).split([len(d) for d in lists])
        for r, ids in zip(requests, token_ids):  # ids: [k]
            q = probs[r.seq_id]
            sampled = q and not self._seqs[r.seq_id].params.is_greedy
            out.append(DraftProposal(ids, torch.stack(q).cpu() if sampled else None))
        return out

    def _project(self, hidden_states: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each request's target rows [n, H*] in the head's space [n, H] (None where it has none):
        one copy to the device and one projection for the batch where the widths agree."""
        given = [h for h in hidden_states if h is not None and h.shape[0] > 0]
        for h in given:
            assert h.ndim == 2, "new_hidden_states must be [n, H*]"
        if not given:
            return [None] * len(hidden_states)
        if len({h.shape[1] for h in given}) == 1:
            rows = self._rows_to_device(given)
            parts = iter(self.head.project_target(rows).split([h.shape[0] for h in given]))
        else:  # each one alone: project_target names the width it wants
            parts = iter([self.head.project_target(h.to(self.device, self.dtype)) for h in given])
        return [next(parts) if h is not None and h.shape[0] > 0 else None for h in hidden_states]

    def _rows_to_device(self, given: list[torch.Tensor]) -> torch.Tensor:
        """The batch's target rows [N, H*] on the head's device, in its dtype. Host rows for a CUDA
        head are gathered into pinned memory and copied without a wait: a pageable copy is staged
        through the driver, several times slower."""
        if self.device.type == "cuda" and all(not h.is_cuda for h in given) and len({h.dtype for h in given}) == 1:
            host = torch.empty((sum(h.shape[0] for h in given), given[0].shape[1]), dtype=given[0].dtype,
                               pin_memory=True)
            torch.cat(given, out=host)
            return host.to(self.device, non_blocking=True).to(self.dtype)
        rows = torch.cat(given) if len(given) > 1 else given[0]
        return rows.to(self.device, self.dtype)

    def _ingest(self, seq: _SeqState, r: DraftRequest, rows: torch.Tensor | None) -> None:
        """Append committed tokens and (projected) hidden rows; drop last step's speculative
        cache entries."""
        seq.tokens.extend(r.new_token_ids)
        if rows is not None:
            seq.pending = rows if seq.pending is None else torch.cat([seq.pending, rows])
        if seq.num_pairs != len(seq.tokens) - 1:
            raise ValueError(f"seq {r.seq_id}: {len(seq.tokens)} committed tokens need "
                             f"{len(seq.tokens) - 1} hidden rows, got {seq.num_pairs}")
        seq.kv_len = seq.num_cached  # last step's speculative entries are dropped

    def _draft(self, seqs: list[_SeqState], ks: list[int], drafts: list[list[int]],
               probs: list[list[torch.Tensor]]) -> None:
        caught = [s for s in seqs if s.pending is not None]
        caught_last = self._catch_up(caught)
        for s in seqs:
            if s.last is None:
                raise ValueError("a sequence needs at least one hidden row before drafting")
        # [B, H]; caught is seqs itself when as long (a subsequence of it)
        hidden = caught_last if len(caught) == len(seqs) else torch.stack([s.last for s in seqs])
        # Greedy sequences without a grammar draft on the device; the others (sampled, or with a
        # grammar) step by step on the host, apart: one JSON-mode request must not pull a batch of
        # 128 onto the host path. (The services always enable structured output, so it is whether
        # a sequence has a grammar that decides, not whether draft_constraints is set.)
        dc = self.draft_constraints
        fast = [i for i, s in enumerate(seqs)
                if s.params.is_greedy and (dc is None or not dc.is_constrained(s.seq_id))]
        if len(fast) == len(seqs):
            self._draft_greedy(seqs, ks, drafts, hidden)
            return
        if fast:
            taken = set(fast)
            rest = [i for i in range(len(seqs)) if i not in taken]
            rest_hidden = hidden[rest]  # a copy, taken before the greedy forwards reuse buffers
            self._draft_greedy([seqs[i] for i in fast], [ks[i] for i in fast], [drafts[i] for i in fast],
                               hidden[fast])
            seqs, ks = [seqs[i] for i in rest], [ks[i] for i in rest]
            drafts, probs, hidden = [drafts[i] for i in rest], [probs[i] for i in rest], rest_hidden
        self._draft_per_step(seqs, ks, drafts, probs, hidden)

    def _draft_per_step(self, seqs: list[_SeqState], ks: list[int], drafts: list[list[int]],
                        probs: list[list[torch.Tensor]], hidden: torch.Tensor) -> None:
        """Sampled or grammar-constrained drafts: each step's logits come to the host (the grammar
        masks and advances there; q is kept for rejection sampling). hidden [B, H]."""
        rows = list(range(len(seqs)))
        for step in range(max(ks)):
            if step > 0:  # pair (g, d_{step}) at position n + step - 1, speculative
                batch = [seqs[i] for i in rows]
                hidden = self._forward(batch, [1] * len(batch), [[drafts[i][-1]] for i in rows], hidden)
                for s in batch:
                    s.kv_len += 1
            bitmask = None if self.draft_constraints is None else \
                self.draft_constraints.masks([seqs[i].seq_id for i in rows])
            tokens, q = self._choose(self._logits(hidden, bitmask), [seqs[i] for i in rows],
                                     [drafts[i] for i in rows])
            allowed = {}
            for j, i in enumerate(rows):
                allowed[i] = (self.draft_constraints is None
                              or self.draft_constraints.advance(seqs[i].seq_id, tokens[j]))
                if allowed[i]:  # a forbidden token (grammar finished) ends this sequence's drafts
                    drafts[i].append(tokens[j])
                    if q is not None:
                        probs[i].append(q[j])
            keep = [j for j, i in enumerate(rows) if ks[i] > step + 1 and allowed[i]]
            rows = [rows[j] for j in keep]
            if not rows:
                break
            hidden = hidden[keep]

    def _draft_greedy(self, seqs: list[_SeqState], ks: list[int], drafts: list[list[int]],
                      hidden: torch.Tensor) -> None:
        """Greedy drafts without a grammar: each step's argmax feeds the next on the device, and
        the host reads them all once at the end. Every sequence takes max(ks) steps (the extra
        entries are speculative, dropped at the next ingest); each keeps its own k."""
        steps = []  # [B] int64 on the device, a step each
        for step in range(max(ks)):
            if step > 0:
                hidden = self._forward(seqs, [1] * len(seqs), steps[-1], hidden)
                for s in seqs:
                    s.kv_len += 1
            steps.append(self.head.greedy_tokens(hidden) if hasattr(self.head, "greedy_tokens")
                         else self.head.logits(hidden).argmax(dim=-1))
        table = torch.stack(steps, dim=1).tolist()  # [B, max(ks)]
        for i, k in enumerate(ks):
            drafts[i].extend(table[i][:k])

    def _logits(self, hidden: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
        """Draft logits in the target vocabulary, masked by the grammar rows when given."""
        if bitmask is not None and hasattr(self.head, "masked_logits"):
            return self.head.masked_logits(hidden, bitmask)  # EAGLE-3 masks in its draft vocabulary
        return mask_logits(self.head.logits(hidden), bitmask)

    def _catch_up(self, seqs: list[_SeqState]) -> torch.Tensor | None:
        """One forward over every sequence's uncached committed pairs; the head's output at each
        one's last pair [n, H] (None without sequences)."""
        if not seqs:
            return None
        lens = [s.pending.shape[0] for s in seqs]
        ids = [s.tokens[s.num_cached + 1:s.num_cached + 1 + m] for s, m in zip(seqs, lens)]  # x_{p+1}
        rows = torch.cat([s.pending for s in seqs]) if len(seqs) > 1 else seqs[0].pending
        last = self._forward(seqs, lens, ids, rows).clone()  # a static output is overwritten later
        for s, m, row in zip(seqs, lens, last.unbind(0)):  # unbind: one op, not a select a row
            s.kv_len += m
            s.num_cached += m
            s.pending = None
            s.last = row
        return last

    def _forward(self, seqs: list[_SeqState], query_lens: list[int], ids: list[list[int]] | torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
        """The head over query_lens[i] new pairs of seqs[i] at positions kv_len.. (ids: their
        x_{p+1}, host lists or a device tensor [n] when each brings one; rows [sum, H]: their
        hidden inputs in order) -> its output at each sequence's last new pair [n, H]."""
        handles, past = [s.slot for s in seqs], [s.kv_len for s in seqs]
        if self.graphs is not None:
            out = self.graphs.forward(handles, past, query_lens, ids, rows)
            if out is not None:
                return out
        n, num_q = len(seqs), max(query_lens)
        if num_q == 1:
            hidden = rows[:, None]  # [B, 1, H]
        else:  # padded to [B, S, H]
            index = torch.tensor([i * num_q + j for i, m in enumerate(query_lens) for j in range(m)])
            hidden = rows.new_zeros(n * num_q, rows.shape[1]).index_copy_(0, index.to(self.device), rows)
            hidden = hidden.view(n, num_q, -1)
        if isinstance(ids, torch.Tensor):
            ids = ids.view(n, 1)
        else:
            ids = torch.tensor([t + [0] * (num_q - len(t)) for t in ids], device=self.device)
        pos = (torch.tensor(past)[:, None] + torch.arange(num_q)).to(self.device)  # [B, S]
        out = self.head(ids, hidden, pos, BatchKV(self._kv, handles, past, query_lens))  # [B, S, H]
        if num_q == 1:
            return out[:, 0]
        return out[torch.arange(n), torch.tensor(query_lens) - 1]

    def _choose(self, logits: torch.Tensor, seqs: list[_SeqState], drafts: list[list[int]]
                ) -> tuple[list[int], torch.Tensor | None]:
        """Greedy argmax, or a sample from the processed draft distribution q (target vocab)."""
        params = [s.params for s in seqs]
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1).tolist(), None
        st = SamplingTensors.from_params(params, logits.device)
        if any(p.repetition_penalty != 1.0 for p in params):
            # q should track the target's p, which is penalised over the context including drafts.
            context = [torch.tensor(s.tokens + d) for s, d in zip(seqs, drafts)]
            logits = apply_repetition_penalty(logits, context, st.repetition_penalty)
        q = processed_probs(logits, st)  # [B, V]; greedy rows one-hot
        # The draft would sit at sequence position len(tokens) + len(drafts so far).
        positions = torch.tensor([len(s.tokens) + len(d) for s, d in zip(seqs, drafts)],
                                 device=logits.device)  # [B]
        return sample_from_probs(q, st.seeds, positions, SALT_DRAFT).tolist(), q
