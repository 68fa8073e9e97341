"""The static-buffer (CUDA-graph) verify path against the eager varlen path, on CPU.

On CPU the static path runs the exact body a CUDA graph captures, without capture; these tests
prove its layout (padded batch buckets, ragged chunks padded to Q rows, fixed-width block tables,
scratch writes) gives the eager path's logits and leaves every real cache entry as eager does.
"""

from __future__ import annotations

import pytest
import torch

from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.graph_layout import batch_buckets, width_bucket
from specd.models.llama_runner import LlamaRunner

TOL = 1e-5


def make_runner(path, static: bool, **overrides) -> LlamaRunner:
    config = dict(block_size=4, max_batch_size=8, session_len=256, device_type="cpu")
    config.update(overrides)
    return LlamaRunner(path, PytorchEngineConfig(**config), use_static_path=static)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def script(runner: LlamaRunner, want_aux: bool = False, after_forward=None) -> list[torch.Tensor]:
    """Prefills, ragged verify steps, rollbacks, a padded bucket; returns every forward's outputs."""
    outs = []

    def fwd(chunks):
        out = runner.forward(chunks, want_hidden=True, want_aux_hidden=want_aux)
        if after_forward is not None:
            after_forward()
        outs.append(out.logits)
        outs.append(out.hidden_states)
        if want_aux:
            outs.append(out.aux_hidden_states)
        return out

    prompts = {0: tokens(13, 0), 1: tokens(3, 1), 2: tokens(22, 2), 3: tokens(1, 3), 4: tokens(7, 4)}
    for s in prompts:
        runner.add_sequence(s)
    fwd([SequenceChunk(s, p) for s, p in prompts.items()])  # prefill: static (Q 22 -> 32, bucket 8: 256 rows)
    # Ragged verify: q = 4, 1, 2, 4, 3 over contexts that end mid-block and on block edges.
    fwd([SequenceChunk(0, tokens(4, 10)), SequenceChunk(1, tokens(1, 11)), SequenceChunk(2, tokens(2, 12)),
         SequenceChunk(3, tokens(4, 13)), SequenceChunk(4, tokens(3, 14))])
    # Rollback of rejected drafts, then verify again over the truncated caches.
    runner.truncate(0, 14)
    runner.truncate(2, 22)
    runner.truncate(3, 5)
    fwd([SequenceChunk(3, tokens(4, 20)), SequenceChunk(0, tokens(4, 21)), SequenceChunk(2, tokens(4, 22))])
    # Three sequences: batch bucket 4 with one padding slot; then plain decode (q = 1).
    fwd([SequenceChunk(1, tokens(2, 30)), SequenceChunk(4, tokens(4, 31)), SequenceChunk(0, tokens(1, 32))])
    fwd([SequenceChunk(s, tokens(1, 40 + s)) for s in prompts])
    runner.free(1)
    fwd([SequenceChunk(2, tokens(4, 50))])  # batch 1
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_static_path_equals_eager(kind, checkpoint):
    path = checkpoint(kind)
    eager, static = make_runner(path, False), make_runner(path, True)
    want, got = script(eager), script(static)
    assert static.static.num_static_forwards == 6  # every forward took the static path, the prefill too
    assert eager.static is None
    worst = max((a - b).abs().max().item() for a, b in zip(want, got))
    print(f"{kind}: max |static - eager| = {worst:.3g}")
    assert worst < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: the CPU twin is the test above")
def test_cuda_graphs_with_unsynchronised_replays_equal_synchronised_ones(checkpoint):
    """On CUDA the graphs copy their inputs from a pinned buffer in the replay itself: the script's
    forwards follow one another without a sync, so each fill must wait for the last replay's copy.
    Bit for bit the outputs of the same graphs run with a sync after every forward; and near the
    eager path's (Triton's fp32 products run on TF32 tensor cores: ~1e-2 relative after 4 layers)."""
    path = checkpoint("llama")  # block size 16: the CUDA attention kernel's smallest key tile
    runners = [make_runner(path, static, device_type="cuda", block_size=16) for static in (True, True, False)]
    graphs, synced, eager = runners
    assert graphs.static.copy_in_graph
    got, want = script(graphs), script(synced, after_forward=torch.cuda.synchronize)
    assert graphs.static.num_captures >= 5 and graphs.static.num_static_forwards == 6
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ref = script(eager)
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
    print(f"cuda: max |graphs - eager| / max |eager| = {worst:.3g}")
    assert worst < 0.1


def test_graphs_dropped_then_captured_again_replay_the_same_bits(checkpoint):
    """drop_graphs (what the step bench's recaptures and launch settings do) frees the graphs and
    their memory pool; capturing again must take a new pool (a stale handle asserted in torch's
    allocator) and replay the first capture's bits. On CPU: the static buffers made again."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = make_runner(checkpoint("llama"), True, device_type=device, block_size=16, dtype="bfloat16")
    first = script(runner)
    for s in (0, 2, 3, 4):  # what script() leaves (it frees 1)
        runner.free(s)
    runner.static.drop_graphs()
    again = script(runner)
    assert runner.static._entries
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs' private pools exist on CUDA only")
def test_a_capture_can_take_memory_the_allocator_holds_cached():
    """With all but 256 MiB of the device's free memory cached by the allocator (a tensor made and
    dropped, as an eager prefill's activations are), a capture that needs 1 GiB still succeeds:
    the chain hands the cached blocks back first, as torch.cuda.graph does (an 8B capture OOMed without)."""
    from specd.models.graph_chain import GraphChain

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")
    del hog
    assert torch.cuda.mem_get_info()[0] < (512 << 20)  # cached, not handed back
    source = torch.arange(1 << 10, device="cuda", dtype=torch.float32)
    chain = GraphChain(torch.cuda.graph_pool_handle(), source.device)
    with chain:
        big = source.repeat(1 << 18)  # 1 GiB, allocated inside the capture
    source.add_(1)
    chain.graphs[0].replay()
    torch.cuda.synchronize()
    assert torch.equal(big.view(1 << 18, 1 << 10)[-1], source)
    del big, chain
    torch.cuda.empty_cache()


def test_a_layout_whose_capture_runs_out_of_memory_runs_without_a_graph(checkpoint, monkeypatch, caplog):
    """A capture's OOM (batch 128 of an 8B model on an H100) leaves that layout on its eager body, with a
    warning, instead of failing the step and every request the engine holds; its outputs are the
    eager runner's, and the layout is not tried again. On CPU the capture is made to raise (the
    static buffers are the CPU twin; CUDA's own OOM is test_a_capture_can_take_memory_...)."""
    path = checkpoint("llama")
    eager, static = make_runner(path, False), make_runner(path, True)
    attempts = []

    def capture_out_of_memory(entry, aux_layer_ids):
        attempts.append((entry.batch, entry.qlen, entry.width))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 252.00 MiB.")

    monkeypatch.setattr(static.static, "use_cuda_graphs", True)
    monkeypatch.setattr(static.static, "_capture", capture_out_of_memory)
    with caplog.at_level("WARNING", logger="specd.models.cuda_graphs"):
        want, got = script(eager), script(static)
    assert static.static.num_static_forwards == 6  # every forward still took the static buffers
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) < TOL
    layouts = list(static.static._entries)
    assert len(attempts) == len(set(attempts)) == len(layouts) == static.static.num_capture_failures
    assert all(not e.graphs and not e.copy_in_graph for e in static.static._entries.values())
    assert sum("did not fit in memory" in r.getMessage() for r in caplog.records) == len(attempts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: the CPU twin is the test above")
def test_captures_out_of_memory_on_cuda_leave_those_layouts_eager_and_the_rest_captured(checkpoint, monkeypatch):
    """Every other capture raises OOM inside the live capture (from its lm_head, as on the H100):
    the capture ends, the layout runs eagerly, later layouts still capture (a new pool where the
    failed graph took the only one), and the outputs stay those of a runner whose captures all
    fit (bf16: the same kernels, launched from a graph or not)."""
    path = checkpoint("llama")
    bf16 = dict(device_type="cuda", block_size=16, dtype="bfloat16")
    want = script(make_runner(path, True, **bf16))
    runner = make_runner(path, True, **bf16)
    model, attempts = runner.static.model, []
    compute_logits = model.compute_logits

    def out_of_memory_in_every_other_capture(hidden):
        if torch.cuda.is_current_stream_capturing():
            attempts.append(hidden.shape)
            if len(attempts) % 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 252.00 MiB.")
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", out_of_memory_in_every_other_capture)
    got = script(runner)
    assert runner.static.num_capture_failures == (len(attempts) + 1) // 2 >= 2
    assert runner.static.num_captures == len(attempts) // 2 >= 2
    worst = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, want))
    assert worst < 1e-2, worst


def test_static_path_aux_hidden_states(checkpoint):
    path = checkpoint("llama")
    eager, static = make_runner(path, False), make_runner(path, True)
    for r in (eager, static):
        r.set_aux_hidden_layers([0, 2, 3])
    want, got = script(eager, want_aux=True), script(static, want_aux=True)
    assert all(g is not None for g in got)
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) < TOL


def test_padding_never_touches_real_caches(checkpoint):
    """Every real cached K/V equals eager's; padding rows and slots landed in the scratch block."""
    path = checkpoint("llama")
    eager, static = make_runner(path, False), make_runner(path, True)
    script(eager), script(static)
    for seq in (0, 2, 3, 4):
        n = eager.num_cached(seq)
        assert static.num_cached(seq) == n
        table = eager.kv_cache.block_table(seq)
        assert static.kv_cache.block_table(seq) == table
        bs = eager.block_size
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
        for layer in range(eager.config.num_hidden_layers):
            for a, b in ((eager.kv_cache.k_caches[layer], static.kv_cache.k_caches[layer]),
                         (eager.kv_cache.v_caches[layer], static.kv_cache.v_caches[layer])):
                flat_a, flat_b = a.flatten(0, 1)[slots], b.flatten(0, 1)[slots]
                assert (flat_a - flat_b).abs().max().item() < TOL
    scratch = static.kv_cache.k_caches[0][static.kv_cache.scratch_block]
    assert scratch.abs().sum() > 0  # padding rows were written, and only there
    assert eager.kv_cache.k_caches[0][eager.kv_cache.scratch_block].abs().sum() == 0


def test_long_prefills_and_oversized_batches_fall_back_to_eager(checkpoint):
    runner = make_runner(checkpoint("llama"), True, max_batch_size=2)
    runner.static.max_prefill_rows = 64
    for s in range(3):
        runner.add_sequence(s)
    runner.forward([SequenceChunk(s, tokens(5, s)) for s in range(3)])  # 3 > largest bucket 2
    assert (runner.static.num_static_forwards, runner.num_eager_forwards) == (0, 1)
    runner.forward([SequenceChunk(s, tokens(33, 20 + s)) for s in range(2)])  # 2 x 64 rows > 64
    assert (runner.static.num_static_forwards, runner.num_eager_forwards) == (0, 2)
    runner.forward([SequenceChunk(s, tokens(17, 30 + s)) for s in range(2)])  # 2 x 32 rows: static
    assert (runner.static.num_static_forwards, runner.num_eager_forwards) == (1, 2)
    runner.forward([SequenceChunk(s, tokens(4, 40 + s)) for s in range(2)])
    assert (runner.static.num_static_forwards, runner.num_eager_forwards) == (2, 2)


def test_prefill_lengths_share_power_of_two_graphs(checkpoint):
    """Prefills of 17..32 tokens run one Q = 32 layout (one capture on CUDA), each equal to eager."""
    path = checkpoint("llama")
    eager, static = make_runner(path, False), make_runner(path, True)
    for n, s in [(17, 0), (32, 1), (25, 2), (3, 3)]:
        outs = []
        for r in (eager, static):
            r.add_sequence(s)
            outs.append(r.forward([SequenceChunk(s, tokens(n, 60 + s))], want_hidden=True))
        assert outs[0].logits.shape == outs[1].logits.shape == (n, eager.config.vocab_size)
        assert (outs[0].logits - outs[1].logits).abs().max().item() < TOL
        assert (outs[0].hidden_states - outs[1].hidden_states).abs().max().item() < TOL
    assert static.static.num_static_forwards == 4
    # the first prefill laid out every prefill (B, Q) at once (captured, on CUDA); the rest is lazy
    assert static.static.prefill_layouts() == [(1, 32), (1, 64), (1, 128), (1, 256), (2, 32), (2, 64), (2, 128),
                                               (4, 32), (4, 64), (8, 32)]
    assert sorted((b, q) for b, q, _, _ in static.static._entries) == sorted(static.static.prefill_layouts() + [(1, 3)])


def test_buckets():
    assert batch_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert [width_bucket(n) for n in (1, 3, 4, 5, 8, 9, 17, 33)] == [1, 3, 4, 5, 8, 10, 20, 40]
    for n in range(1, 300):
        w = width_bucket(n)
        assert n <= w < 1.25 * n + 1


def test_engine_greedy_output_is_the_same_on_the_static_path(tiny_models):
    """ngram k=3 with ragged draft counts: the static path's engine emits eager's tokens exactly."""
    from specd.engine.engine import SpecEngine
    from specd.proposers.ngram import NgramProposer
    from specd.sampling_params import SamplingParams

    target = tiny_models["target-llama"]
    prompts = [(tokens(6, i) * 3)[:14 + i] for i in range(5)]
    results = []
    for static in (False, True):
        runner = LlamaRunner(target, PytorchEngineConfig(block_size=8, max_batch_size=8, device_type="cpu"),
                             use_static_path=static)
        engine = SpecEngine(runner, NgramProposer(1, 3), 3, max_batch_size=8, max_model_len=256)
        seqs = engine.generate(prompts, [SamplingParams(max_new_tokens=20 + i, ignore_eos=True)
                                         for i in range(5)])
        results.append([s.output_token_ids for s in seqs])
        stats = engine.stats  # five prompts of 14-18 tokens, admitted together: one prefill
        assert (stats.num_prefills, stats.num_prefill_tokens) == (1, sum(len(p) for p in prompts))
        assert stats.timings.prefill > 0
        # static: batch bucket 8 x Q 32 = 256 rows, within max_prefill_rows: the static path
        assert stats.num_eager_prefills == (0 if static else 1)
        if static:
            assert runner.static.num_static_forwards > 5
    assert results[0] == results[1]
