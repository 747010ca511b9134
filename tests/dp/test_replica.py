"""`EngineReplica` in this process (no Ray): outputs and KV events in frames, utilities, stop."""

from __future__ import annotations

import asyncio

from inferengine.core.block_pool import KV_CLEARED, KV_CPU_CLEARED, KV_CPU_STORED, KV_STORED
from inferengine.core.engine_io import EngineCoreRequest
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.dp.replica import EngineReplica, decode_frame, encode_requests
from inferengine.engine.arg_utils import EngineArgs
from inferengine.sampling_params import SamplingParams


def test_a_replica_streams_outputs_with_the_kv_events_of_its_pool(tiny_checkpoint):
    config = EngineArgs(
        model=str(tiny_checkpoint("qwen3")), max_model_len=128, kv_cache_memory=8 << 20
    ).create_engine_config()
    replica = EngineReplica(config, replica_id=3)
    prompt = list(range(5, 45))  # 40 tokens: 2 full blocks of 16
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def go():
        info = await replica.ready()
        assert info["replica_id"] == 3 and info["pid"] > 0 and info["num_blocks"] > 1
        await replica.add_requests(encode_requests([EngineCoreRequest("a", prompt, params)]))
        tokens, events = [], []
        stream = replica.outputs()
        while len(tokens) < 4:
            for raw in await asyncio.wait_for(stream.__anext__(), 30):
                frame = decode_frame(raw)
                events += frame.kv_events
                for out in frame.outputs.outputs:
                    tokens += out.new_token_ids
        assert events[:2] == [(KV_STORED, h) for h in hash_prompt_blocks(prompt, 16)]
        stats = await replica.utility("get_stats", [])
        assert stats["num_blocks"] == info["num_blocks"] - 1
        assert await replica.utility("reset_prefix_cache", []) is True
        frame = decode_frame((await asyncio.wait_for(stream.__anext__(), 30))[-1])
        assert frame.kv_events[-1] == (KV_CLEARED, b"")
        await stream.aclose()
        await replica.shutdown()

    asyncio.run(go())


def test_a_replica_with_a_cpu_tier_streams_the_tier_s_kv_events(tiny_checkpoint):
    config = EngineArgs(
        model=str(tiny_checkpoint("qwen3")),
        max_model_len=128,
        num_gpu_blocks_override=12,  # all free pages within the tier's write-back window
        kv_offloading_size=0.01,
    ).create_engine_config()
    replica = EngineReplica(config, replica_id=0)
    first, second = list(range(5, 45)), list(range(50, 90))  # 2 full blocks of 16 each
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def go():
        stream = replica.outputs()
        events: list[tuple[int, bytes]] = []

        async def run(request_id: str, prompt: list[int]) -> None:
            request = EngineCoreRequest(request_id, prompt, params)
            await replica.add_requests(encode_requests([request]))
            while True:
                frames = [decode_frame(raw) for raw in await asyncio.wait_for(anext(stream), 30)]
                for frame in frames:
                    events.extend(frame.kv_events)
                if any(o.finish_reason is not None for f in frames for o in f.outputs.outputs):
                    return

        await run("a", first)
        await run("b", second)  # its steps save a's freed pages to the tier ahead of time
        saved = [h for kind, h in events if kind == KV_CPU_STORED]
        assert set(hash_prompt_blocks(first, 16)) <= set(saved)  # a's full blocks
        assert await replica.utility("reset_prefix_cache", []) is True
        frame = decode_frame((await asyncio.wait_for(anext(stream), 30))[-1])
        assert frame.kv_events[-2:] == [(KV_CLEARED, b""), (KV_CPU_CLEARED, b"")]
        await stream.aclose()
        await replica.shutdown()

    asyncio.run(go())
