"""vLLM KV events for the blocks kvpool's vLLM connector saves (KVPoolConnector.take_events).

A router that places requests by where their prefix is cached (vLLM's --kv-events-config, read
by llm-d or Dynamo) learns of vLLM's own cache from its block pool's events (medium "GPU"), and
of the pool's from the connector's: BlockStored with vLLM's block hashes, each block's parent
and tokens, medium "CPU", for the blocks every worker put, and BlockRemoved for those the
connector removes again. Driven by vLLM's real scheduler (tests/vllm_scheduler_sim.py's
instance, its KV events on and its publisher recorded) and, for the failure paths, by vLLM's
own classes step by step as in tests/test_integration_vllm.py, against a LocalCluster.
"""

from __future__ import annotations

import json
import random

import pytest
import vllm_on_cpu  # noqa: E402, F401  (before vLLM)
from conftest import wait_until

pytest.importorskip("torch", reason="needs torch==2.13.0")
pytest.importorskip("einops", reason="vLLM's model registry imports it (scripts/install-peers.sh vllm)")
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed (scripts/install-peers.sh vllm)")
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvpool import Store  # noqa: E402
from kvpool.errors import ErrorCode  # noqa: E402
from kvpool.integrations.vllm import KVPoolWorkerMetadata  # noqa: E402
from tests import vllm_scheduler_sim as sim  # noqa: E402
from tests.test_integration_vllm import (  # noqa: E402
    BLOCK_SIZE,
    NUM_BLOCKS,
    PROMPT,
    connector,
    first_prefill,
    paged_cache,
    request,
    run_worker_step,
    second_turn,
    vllm_config,
)

EVENTS_ON = KVEventsConfig(enable_kv_cache_events=True, publisher="null")


def external(block_hash: bytes):
    """A block hash as vLLM's KV events carry it (by default its low 64 bits, an int)."""
    return maybe_convert_block_hash(block_hash)


def is_in_pool(event, kind) -> bool:
    return isinstance(event, kind) and event.medium == "CPU"


def blocks_described(events: list, medium: str) -> dict:
    """What the BlockStored events of `medium` tell a router of each block: hash -> (its
    parent's hash, its tokens, its extra keys)."""
    described = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            parent, size = event.parent_block_hash, event.block_size
            extra_keys = event.extra_keys or [None] * len(event.block_hashes)
            for index, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[index * size : (index + 1) * size]
                described[block_hash] = (parent, tokens, extra_keys[index])
                parent = block_hash
    return described


class RecordingPublisher:
    """vLLM's KV event publisher, recording each batch, and the blocks the connector
    announced stored that the pool did not hold when vLLM published them."""

    def __init__(self, store) -> None:
        self.store, self.events, self.announced_before_put = store, [], []

    def publish(self, batch) -> None:
        self.events += batch.events
        announced = [h for e in batch.events if is_in_pool(e, BlockStored) for h in e.block_hashes]
        if announced:
            held = {external(bytes.fromhex(key.rsplit("@", 1)[1])) for key in self.store.list_objects().keys}
            self.announced_before_put += [h for h in announced if h not in held]

    def shutdown(self) -> None:
        pass


def test_vllms_scheduler_publishes_the_blocks_saved_to_the_pool_as_it_publishes_its_own(
    make_cluster, tmp_path, monkeypatch
):
    """Two turns of a conversation through vLLM's real scheduler with KV events on: each
    prompt block the connector saved is published once the pool holds it, under the hash,
    parent and tokens vLLM's block pool published it with (medium "GPU"), with medium "CPU";
    the second turn's first new block names the first turn's last as its parent."""
    cluster = make_cluster(1, "16MiB")
    (tmp_path / "config.json").write_text(json.dumps(sim.TINY_MODEL_CONFIG))
    args = sim.arguments(["--blocks", "32", "--max-seqs", "2"])
    args.model_dir = str(tmp_path)
    plain_config = sim.make_vllm_config

    def config_with_events(args, master):
        config = plain_config(args, master)
        config.kv_events_config = EVENTS_ON
        return config

    monkeypatch.setattr(sim, "make_vllm_config", config_with_events)
    problems = []
    instance = sim.Instance("A", args, cluster.master_endpoint, sim.Stats(), lambda *problem: problems.append(problem))
    publisher = instance.scheduler.kv_event_publisher = RecordingPublisher(instance.worker._store)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(args.block_size, sha256)
    rng = random.Random(0)
    try:
        turns, tokens = [], [rng.randrange(3, 900) for _ in range(22)]  # 5 full blocks and 2 tokens
        for turn in range(2):
            turns.append(Request(f"t{turn}", list(tokens), SamplingParams(max_tokens=3, ignore_eos=True), None,
                                 cache_salt="tenant-1", block_hasher=hasher, session_id="conversation-7"))  # fmt: skip
            instance.add(turns[-1])
            while instance.scheduler.has_requests():  # until its saves are reported too
                instance.engine_step(0.0, rng)
            tokens = list(turns[-1].all_token_ids) + [rng.randrange(3, 900) for _ in range(7)]
    finally:
        instance.worker.shutdown()
        instance.scheduler.shutdown()
    assert not problems
    in_pool, in_vllm = blocks_described(publisher.events, "CPU"), blocks_described(publisher.events, "GPU")
    first, second = [[external(h) for h in turn.block_hashes] for turn in turns]
    # Every full prompt block of each turn: the first's 5, then the second's other 3 (32 tokens: 8 blocks).
    assert list(in_pool) == [*first[:5], *second[5:8]]
    assert {h: in_vllm[h] for h in in_pool} == in_pool  # as vLLM described them
    assert in_pool[second[5]][0] == first[4]  # the second turn's chain goes on from the first's
    assert in_pool[first[0]] == (None, turns[0].prompt_token_ids[:BLOCK_SIZE], ("tenant-1",))  # its salt
    stored = [e for e in publisher.events if is_in_pool(e, BlockStored)]
    assert {(e.block_size, e.group_idx, e.lora_name, e.session_id) for e in stored} == {
        (BLOCK_SIZE, 0, None, "conversation-7")
    }
    assert publisher.announced_before_put == []
    assert not [e for e in publisher.events if is_in_pool(e, BlockRemoved)]


def scheduler_with_pool(config):
    """A scheduler-side connector with vLLM's block pool bound, as vLLM's scheduler binds it."""
    sched = connector(config, KVConnectorRole.SCHEDULER)
    sched.bind_gpu_block_pool(BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE))
    return sched


def test_a_block_a_worker_did_not_put_is_not_announced(make_cluster):
    """At TP 2, rank 1's put of the second block meets another writer's put of that key in
    flight (REPLICA_IS_NOT_READY): the pool does not hold that block for every rank. The
    first and third blocks are announced, each with its own parent; the second is not.
    With the master gone, no save of a later prompt is announced."""
    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    config.kv_events_config = EVENTS_ON
    config.parallel_config.tensor_parallel_size = 2
    sched = scheduler_with_pool(config)
    workers = [connector(config, KVConnectorRole.WORKER) for _ in range(2)]
    other_writer = Store(cluster.master_endpoint)
    try:
        for rank, worker in enumerate(workers):
            worker.tp_rank = rank  # what _parallel_ranks() gives TP rank `rank`
            worker.register_kv_caches(paged_cache(seed=30 + rank))
        prompt = request("a-1", PROMPT)
        meta = first_prefill(sched, "a-1", [5, 6, 7, 8])
        taken = workers[1]._key(meta.saves[0].block_hashes[1], prefix=meta.key_prefix)
        reply = other_writer._run(other_writer._async._put_start([taken], [[memoryview(bytes(64))]], None))
        assert reply.codes == [ErrorCode.OK]  # its bytes never come: the key stays in flight
        assert [run_worker_step(w, meta) for w in workers] == [set(), set()]  # puts on their saver threads
        report = wait_until(workers[0].build_connector_worker_meta, 10).aggregate(
            wait_until(workers[1].build_connector_worker_meta, 10)
        )
        assert report.failed == {0: [1]}
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
        hashes = [external(h) for h in prompt.block_hashes]
        assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.medium) for e in sched.take_events()] == [
            ([hashes[0]], None, PROMPT[:4], "CPU"),
            ([hashes[2]], hashes[1], PROMPT[8:12], "CPU"),
        ]
        assert list(sched.take_events()) == []  # each once

        cluster.master.kill()
        meta = first_prefill(sched, "a-2", [9, 10, 11, 12])  # a prompt the lookup could not find
        assert meta.saves == []  # the lookup opened the breaker: no save is planned (vllm.py _plan_save)
        assert [run_worker_step(w, meta) for w in workers] == [set(), set()]
        assert workers[0].build_connector_worker_meta() is None
        assert list(sched.take_events()) == []
    finally:
        for side in [*workers, sched]:
            side.shutdown()
        other_writer.close()


@pytest.mark.parametrize("reported_before", [True, False], ids=["reported-before", "reported-with-the-failure"])
def test_the_saves_removed_after_a_failed_load_are_announced_removed(make_cluster, reported_before):
    """A load fails: the connector removes every block saved in the steps it ran beside
    (_remove_doomed_saves), the first prompt's three blocks among them, and says so in one
    BlockRemoved. Announced stored when their save was reported a step before; not at all
    when the workers report it with the failure (they were announced, then removed in the
    same batch). The block saved in the failed step (which the worker skipped) is never
    announced stored."""
    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    config.kv_events_config = EVENTS_ON
    sched = scheduler_with_pool(config)
    worker = connector(config, KVConnectorRole.WORKER)
    try:
        worker.register_kv_caches(paged_cache(seed=3))
        assert run_worker_step(worker, first_prefill(sched, "a-1", [0, 1, 2, 3])) == set()
        saved = wait_until(worker.build_connector_worker_meta, 10)
        first = [external(h) for h in request("a-1", PROMPT).block_hashes[:3]]
        if reported_before:
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=saved))
            assert [(e.block_hashes, e.medium) for e in sched.take_events()] == [(first, "CPU")]

        meta = second_turn(sched)  # loads the 3 blocks into 6, 7 and 8, saves block 9
        worker._store.remove(worker._key(meta.loads[0].block_hashes[1], prefix=meta.key_prefix), force=True)
        failed = run_worker_step(worker, meta)
        assert failed == {7}
        report = wait_until(worker.build_connector_worker_meta, 10)
        assert report.failed == {1: [0]}  # the failed step's save: skipped
        if not reported_before:
            report = saved.aggregate(report)
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report, invalid_block_ids=failed))
        fourth = external(request("r-2", PROMPT + [1, 2, 3, 4]).block_hashes[3])
        assert [(type(e), e.block_hashes, e.medium) for e in sched.take_events()] == [
            (BlockRemoved, [*first, fourth], "CPU")
        ]
        keys = [worker._key(h.hex()) for h in request("a-1", PROMPT).block_hashes[:3]]
        wait_until(lambda: not any(worker._store.batch_exists(keys)), timeout_s=10)  # as announced
    finally:
        for side in (worker, sched):
            side.shutdown()


def test_with_kv_events_off_the_connector_keeps_nothing_for_them(make_cluster):
    """vLLM asks take_events every step whether KV events are on or not: off, the connector
    records nothing for them (no request kept, no event built) and answers none."""
    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    sched = scheduler_with_pool(config)
    worker = connector(config, KVConnectorRole.WORKER)
    try:
        worker.register_kv_caches(paged_cache(seed=4))
        meta = first_prefill(sched, "a-1", [0, 1, 2, 3])
        assert sched._save_events is None and sched._requests["a-1"].request is None
        assert run_worker_step(worker, meta) == set()
        saved = wait_until(worker.build_connector_worker_meta, 10)
        assert saved == KVPoolWorkerMetadata({0: 1})
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=saved))
        assert list(sched.take_events()) == []
    finally:
        for side in (worker, sched):
            side.shutdown()
