"""The static buffers of one verify / decode layout (B sequences, Q rows each, NB blocks per
block table; cuda_graphs.py): one packed int64 buffer on the device for every input, its host
side, and on CUDA the graphs captured over them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StaticEntry:
    """The static buffers (and, on CUDA, the graph) of one (B, Q, NB, aux) key."""

    batch: int
    qlen: int
    width: int  # NB, blocks per slot
    packed: torch.Tensor  # [4 * B * Q + B + B * NB] int64 on the device (views() says what)
    host: torch.Tensor  # packed's host side (pinned under a graph, else pageable), packed itself on CPU
    blank: np.ndarray  # the host buffer of an all-padding batch, the start of every fill
    host_array: np.ndarray | None = None  # host as numpy, and its views(), made once
    host_views: tuple = ()
    row_numbers: np.ndarray | None = None  # 0 .. B * Q - 1: the gather rows of a batch of full chunks
    real_rows: torch.Tensor | None = None  # views()[5], made once
    hidden: torch.Tensor | None = None  # [B * Q, H] outputs of the last run / the capture
    aux: torch.Tensor | None = None  # [B * Q, n_aux * H] or None
    logits: torch.Tensor | None = None  # [B * Q, V] float32
    graphs: "tuple[torch.cuda.CUDAGraph, ...]" = ()  # replayed in order (CUDA); empty: the body runs eagerly
    copy_in_graph: bool = False  # the graph copies host -> packed itself (else the fill does)
    copied: "torch.cuda.Event | None" = None  # recorded by the graph once its input copy is done

    def views(self, p: torch.Tensor | np.ndarray | None = None) -> tuple:
        """(input_ids [BQ], positions [BQ], slots [BQ], ctx_lens [B], block_tables [B, NB],
        real_rows [BQ]) of the device buffer, or of p (the host side) with the same layout.
        real_rows: the flat row of each real token, in chunk order (the outputs' gather index)."""
        bq, b = self.batch * self.qlen, self.batch
        p = self.packed if p is None else p
        end = 3 * bq + b + b * self.width
        return (p[:bq], p[bq:2 * bq], p[2 * bq:3 * bq], p[3 * bq:3 * bq + b],
                p[3 * bq + b:end].reshape(b, self.width), p[end:])


    @classmethod
    def new(cls, batch: int, qlen: int, width: int, device: torch.device, scratch_block: int, block_size: int,
            copy_in_graph: bool) -> "StaticEntry":
        """The buffers of a (B, Q, NB) layout, holding an all-padding batch: positions continue the
        sequence (ctx + i; ctx 0 here), slots are the scratch block's, block tables all scratch,
        gather rows 0."""
        bq = batch * qlen
        size = 4 * bq + batch + batch * width
        packed = torch.zeros(size, dtype=torch.int64, device=device)
        host = (packed if device.type == "cpu" else
                torch.zeros(size, dtype=torch.int64, pin_memory=copy_in_graph))
        blank = np.zeros(size, dtype=np.int64)
        entry = cls(batch, qlen, width, packed, host, blank, copy_in_graph=copy_in_graph)
        _, pos, slot, _, tables, _ = entry.views(blank)
        pos[:] = np.tile(np.arange(qlen, dtype=np.int64), batch)
        slot[:] = scratch_block * block_size + pos % block_size
        tables[:] = scratch_block
        entry.host_array = host.numpy()
        entry.host_views = entry.views(entry.host_array)
        entry.row_numbers = np.arange(bq, dtype=np.int64)
        entry.real_rows = entry.views()[5]
        return entry


@dataclass(frozen=True)
class PreparedBatch:
    """A batch written into an entry's buffers and not yet launched (StaticForward.prepare)."""

    entry: StaticEntry
    aux_layer_ids: tuple[int, ...]
    total: int  # T, real tokens
    chunk_lens: tuple[int, ...]
