"""What a runner decides before it loads anything: its device, its dtype, how many KV cache
blocks to allocate, and EAGLE-3's default feature layers. Shared by LlamaRunner and HFRunner."""

from __future__ import annotations

import torch

from specd.messages import PytorchEngineConfig
from specd.models.hf_config import LlamaArchConfig
from specd.models.kv_cache import PagedKVCache

CPU_KV_CACHE_BYTES = 4 << 30  # CPU has no "free GPU memory" to take a fraction of: cap at 4 GiB
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def select_device(engine_config: PytorchEngineConfig) -> torch.device:
    if engine_config.device_type == "cuda" or (
            engine_config.device_type == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def select_dtype(engine_config: PytorchEngineConfig, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA, float32 on CPU (CPU half-precision matmuls are slow and lossy)."""
    if engine_config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[engine_config.dtype]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high feature layers: (2, L // 2, L - 3), clamped for tiny models."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


def num_cache_blocks(engine_config: PytorchEngineConfig, config: LlamaArchConfig, session_len: int,
                     dtype: torch.dtype, device: torch.device, num_kv_heads: int | None = None) -> int:
    """Blocks to allocate: num_gpu_blocks when set, else what the engine can use (max_batch_size
    full sessions), capped by what memory allows: cache_max_entry_count of the free GPU memory, or
    CPU_KV_CACHE_BYTES. Never more than can be used: a drafter sharing the GPU with its verifier
    (`specd serve api_server` on one GPU) would otherwise take 80% of the memory for a small
    draft model's cache and leave the target too little for its activations."""
    if engine_config.num_gpu_blocks > 0:
        return engine_config.num_gpu_blocks
    block_size = engine_config.block_size
    per_block = PagedKVCache.bytes_per_block(config.num_hidden_layers, block_size,
                                             num_kv_heads or config.num_key_value_heads,
                                             config.head_dim, dtype)
    blocks_per_seq = -(-session_len // block_size)
    wanted = engine_config.max_batch_size * blocks_per_seq
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * engine_config.cache_max_entry_count) // per_block
        return max(1, min(budget, wanted))
    # Never less than one full session, so a single request always fits.
    return max(blocks_per_seq, min(wanted, CPU_KV_CACHE_BYTES // per_block))


def check_shared_cache(kv_cache: PagedKVCache, num_layers: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """A cache handed to another runner (LlamaRunner's kv_cache) must be the shape it would build."""
    k = kv_cache.k_caches[0]
    same_device = k.device.type == device.type and device.index in (None, k.device.index)  # "cuda" is cuda:N
    want = (num_layers, block_size, num_kv_heads, head_dim, dtype, device)
    have = (kv_cache.num_layers, kv_cache.block_size, k.shape[2], k.shape[3], k.dtype, k.device)
    if have[:5] != want[:5] or not same_device:
        raise ValueError(f"kv_cache: a shared cache must have (layers, block size, KV heads, head dim, "
                         f"dtype, device) {want}, got {have}")


def kv_cache_for(engine_config: PytorchEngineConfig, config: LlamaArchConfig, session_len: int, dtype: torch.dtype,
                 device: torch.device, tp: int, parallel=None, shared: PagedKVCache | None = None) -> PagedKVCache:
    """A runner's KV cache: `shared` (another runner's, shape-checked) or a new one sized by
    num_cache_blocks; under tensor parallelism every rank holds the least rank's block count."""
    kv_heads = config.num_key_value_heads // tp
    if shared is not None:
        check_shared_cache(shared, config.num_hidden_layers, engine_config.block_size, kv_heads, config.head_dim,
                           dtype, device)
        return shared
    num_blocks = num_cache_blocks(engine_config, config, session_len, dtype, device, kv_heads)
    if parallel is not None:  # every rank must hold the same block ids: take the least
        count = torch.tensor([num_blocks], device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=parallel.group)
        num_blocks = int(count.item())
    return PagedKVCache(num_layers=config.num_hidden_layers, num_blocks=num_blocks, block_size=engine_config.block_size,
                        num_kv_heads=kv_heads, head_dim=config.head_dim, dtype=dtype, device=device,
                        prefix_caching=engine_config.enable_prefix_caching)
