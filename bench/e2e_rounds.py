"""The e2e bench's client side: its prompts, and a round's requests sent over the gRPC Generate API
(all of a wave at once, waves back to back), failing fast when a service of the stack dies."""

from __future__ import annotations

import random
import threading
import time


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def waves_for(batch: int, min_requests: int) -> int:
    """How many back-to-back waves of `batch` requests make a round of at least min_requests.

    Why: the replay drafter draws its corruption once per prompt, so one request's ~45 steps stray
    from the expected acceptance: one prompt alone realized 2.82 at 3.00 at batch 1.
    Eight requests (~350 steps) come within ~0.07 of it (a step's tokens have a standard deviation
    of ~1.2 at acceptance 3, k = 3); batches of min_requests or more keep one wave."""
    if batch < 1 or min_requests < 1:
        raise ValueError(f"batch and min_requests: must be >= 1, got {batch} and {min_requests}")
    return -(-min_requests // batch)


def _dead_children(stack) -> list[str]:
    return [f"{name} exited with code {proc.returncode}" for name, proc in stack.children
            if proc.poll() is not None]


def generate_all(stack, prompts: list[list[int]], max_tokens: int, timeout_s: float = 900.0
                 ) -> tuple[float, list]:
    """Send every prompt at once (gRPC futures); fail fast, cancelling the rest, if a service dies."""
    import grpc

    from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        remaining = [len(prompts)]
        finished = threading.Event()
        t_end = [0.0]
        lock = threading.Lock()

        def on_done(_future) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    t_end[0] = time.perf_counter()
                    finished.set()

        t0 = time.perf_counter()
        futures = [stub.Generate.future(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=max_tokens, ignore_eos=True,
            sampling=common_pb2.SamplingParameters(temperature=0.0), has_seed=True), timeout=timeout_s)
            for prompt in prompts]
        for f in futures:
            f.add_done_callback(on_done)
        try:
            while not finished.wait(0.5):  # the wall time comes from the last reply, not this poll
                dead = _dead_children(stack)
                if dead:
                    raise RuntimeError(f"a service died mid-run: {'; '.join(dead)}")
            replies = [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
        return t_end[0] - t0, replies


def generate_waves(stack, prompts: list[list[int]], batch: int, waves: int, max_tokens: int
                   ) -> tuple[float, list]:
    """`waves` waves of `batch` requests, each sent when the last one's replies are in; the wall
    time is the waves' own, summed (the client's turn-around between them is not the stack's)."""
    wall, replies = 0.0, []
    for w in range(waves):
        wave_wall, wave_replies = generate_all(stack, prompts[w * batch:(w + 1) * batch], max_tokens)
        wall += wave_wall
        replies += wave_replies
    return wall, replies
