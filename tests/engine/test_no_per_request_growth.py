"""No state kept per finished request: after hundreds of requests, no dict, list or set in the
process holds hundreds more entries than before. The engine core runs in the test's process
(MINIVLLM_ENABLE_MULTIPROCESSING=0), so the scheduler's, the KV cache manager's, the model
runner's and the output processor's containers are all seen. A leak of this kind grows with
every request; the soak's memory figure (bench soak) cannot tell it from the allocator settling.
"""

from __future__ import annotations

import collections
import gc
import random

from minivllm import SamplingParams

GROWTH_LIMIT = 200  # entries; the second batch has 400 requests
# Exact types: isinstance() would ask lazy proxies (the openai client's) for __class__ and so
# import modules, whose namespaces then grow during the test.
CONTAINER_TYPES = (dict, list, set, collections.OrderedDict, collections.defaultdict, collections.deque)


def _containers() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) in CONTAINER_TYPES]


def test_no_container_grows_with_the_requests(monkeypatch, make_tiny_model, make_llm):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    llm = make_llm(make_tiny_model("llama"), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    rng = random.Random(0)

    def run(num_requests: int) -> None:
        prompts = [[rng.randrange(5, 200) for _ in range(rng.randint(3, 40))] for _ in range(num_requests)]
        # A random stop token each: some may finish by it rather than by length.
        params = [SamplingParams(max_tokens=rng.randint(1, 6), temperature=1.0, seed=i,
                                 stop_token_ids=[rng.randrange(5, 200)]) for i in range(num_requests)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert len(outputs) == num_requests

    run(50)
    before = {id(o): len(o) for o in _containers()}
    run(400)
    grown = [f"{type(o).__name__} of {len(o)}: {list(o)[:3]!r:.200}" for o in _containers()
             if o is not before and len(o) - before.get(id(o), 0) >= GROWTH_LIMIT]
    assert not grown, grown
