"""Paged KV cache, prefix caching, mixed-phase batches and continuous batching (CPU)."""
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import diffuserve as ds
from diffuserve.random_checkpoint import write_random_checkpoint

CANVAS, WINDOW, BLOCK = 8, 12, 4
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
             sliding_window=WINDOW, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("batching") / "m", canvas_length=CANVAS, seed=3, **SMALL)


def all_free(stats):
    return stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.fixture
def make_llm(path):
    """LLMs built by a test; afterwards every KV block must be free again, in each."""
    made = []

    def make(**kw):
        llm = ds.LLM(path, kv_block_size=BLOCK, **kw)
        made.append(llm)
        return llm
    yield make
    for llm in made:
        stats = llm.stats()
        assert all_free(stats), f"leaked KV blocks: {stats}"
        assert stats["running"] == stats["waiting"] == 0


def params(seed, n=24, **kw):
    return ds.SamplingParams(max_new_tokens=n, seed=seed, eos_token_id=[], max_denoising_steps=5, **kw)


def alone(llm, prompt, p):
    return llm.generate([prompt], p)[0]


def test_batch_equals_each_alone(make_llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 17, 40, 9, 25)]
    ps = [params(i, n=8 * (i + 1)) for i in range(5)]
    # A small token budget forces chunked prefill and mixes prefill chunks with denoising.
    batched = make_llm(max_num_batched_tokens=24).generate(prompts, ps)
    ref = make_llm()
    for prompt, p, out in zip(prompts, ps, batched):
        expected = alone(ref, prompt, p)
        assert out.token_ids == expected.token_ids
        assert out.denoise_steps == expected.denoise_steps


@pytest.mark.parametrize("budget", [CANVAS, CANVAS + 4, 2 * CANVAS - 1])
def test_budget_below_a_commit_plus_a_canvas_still_progresses(make_llm, budget):
    """A token budget smaller than a pending commit plus the canvas: the commit is encoded on
    a step of its own (or in chunks) and the denoising follows; the tokens are the same."""
    prompts = [list(range(1, 12)), list(range(5, 9))]
    ps = [params(1, n=32), params(2, n=24)]
    tight = make_llm(max_num_batched_tokens=budget).generate(prompts, ps)
    ref = make_llm()
    for prompt, p, out in zip(prompts, ps, tight):
        assert out.token_ids == alone(ref, prompt, p).token_ids


def test_commit_fusion_saves_a_forward_per_block(make_llm):
    """Fused, a request's forwards are exactly its denoise steps: the prompt's last chunk and
    every commit ride along with a denoise step. Unfused, each costs a pass of its own."""
    prompt, p = list(range(1, 20)), params(5, n=32)
    fused, unfused = make_llm(), make_llm(fuse_commit=False)
    a, b = alone(fused, prompt, p), alone(unfused, prompt, p)
    assert a.token_ids == b.token_ids
    blocks = len(a.denoise_steps)
    assert fused.stats()["forward_passes"] == sum(a.denoise_steps)
    assert unfused.stats()["forward_passes"] == sum(a.denoise_steps) + 1 + (blocks - 1)  # + prefill + commits


def test_prefix_cache_shares_blocks_and_gives_identical_logits(path):
    model = ds.Model.load(path, kv_block_size=BLOCK)
    prefix = list(range(5, 5 + 6 * BLOCK))  # six whole blocks
    first = model.sequence()
    first.prefill(prefix + [1, 2])
    free_before = model.cache_stats()["kv_blocks_free"]

    second = model.sequence()
    second.prefill(prefix + [3])
    stats = model.cache_stats()
    assert stats["prefix_cache_hits"] == len(prefix)
    held = second.kv_blocks()
    # Shared: of its 7 full-attention blocks only the last is new; of the sliding blocks
    # only the one past the prefix. The rest are the first sequence's, by reference.
    assert held["full"] == 7
    assert free_before - stats["kv_blocks_free"] == 2

    cold = ds.Model.load(path, kv_block_size=BLOCK).sequence()
    cold.prefill(prefix + [3])
    canvas = np.arange(CANVAS)
    np.testing.assert_array_equal(second.denoise(canvas), cold.denoise(canvas))
    for layer in range(3):
        np.testing.assert_array_equal(second.kv(layer)[0], cold.kv(layer)[0])

    # Released blocks stay cached until needed: a third sequence still hits after both are gone.
    del first, second
    assert all_free(model.cache_stats())
    third = model.sequence()
    third.prefill(prefix)
    assert model.cache_stats()["prefix_cache_hits"] == 2 * len(prefix)
    del third
    assert all_free(model.cache_stats())


def test_prefix_cache_takes_a_block_for_its_tokens_not_their_hash(tmp_path):
    """Two 16-token blocks with the same 64-bit FNV-1a hash, by which the cache had keyed its
    blocks: the second had been handed the first's KV (and generate its tokens). A cached block
    serves only its own tokens after its own prefix."""
    a = [93, 119, 17, 66, 243, 150, 237, 222, 173, 233, 110, 114, 89, 117, 127, 96]
    b = [91, 58, 233, 207, 214, 149, 18, 93, 127, 160, 35, 126, 65, 30, 48, 98]
    path = write_random_checkpoint(tmp_path / "m", canvas_length=CANVAS, seed=3, **{**SMALL, "vocab_size": 256})
    model = ds.Model.load(path, kv_block_size=16)
    first = model.sequence()
    first.prefill(a + a + [1])
    second = model.sequence()
    second.prefill(b + a + [1])  # its second block's tokens are cached, after another prefix
    assert model.cache_stats()["prefix_cache_hits"] == 0
    cold = ds.Model.load(path, kv_block_size=16).sequence()
    cold.prefill(b + a + [1])
    canvas = np.arange(CANVAS)
    np.testing.assert_array_equal(second.denoise(canvas), cold.denoise(canvas))
    third = model.sequence()  # the same tokens still hit
    third.prefill(a + a + [2])
    assert model.cache_stats()["prefix_cache_hits"] == 32


def test_a_cache_full_evicts_a_cached_prefix_from_its_end(tmp_path):
    """One block evicted of a cached 8-block prefix leaves the other 7 to hit. Blocks had been
    released (and so evicted) first to last: the prefix's first block went, and with it the
    only way to find the rest (0 hits)."""
    path = write_random_checkpoint(tmp_path / "m", canvas_length=CANVAS, seed=3,
                                   **{**SMALL, "layer_types": ["full_attention"] * 3})
    # A block's bytes, to within a 170th (its bytes' exact count is no stat): a cache of 24.
    block_bytes = (1 << 20) // ds.Model.load(path, kv_block_size=16, kv_cache_memory_bytes=1 << 20).cache_stats()[
        "kv_blocks_total"]
    model = ds.Model.load(path, kv_block_size=16, kv_cache_memory_bytes=24 * block_bytes)
    assert model.cache_stats()["kv_blocks_total"] == 24
    prefix = [5 + i % 50 for i in range(8 * 16)]
    seq = model.sequence()
    seq.prefill(prefix + [1])  # 9 blocks: the prefix's 8 stay cached once it is gone
    del seq
    seq = model.sequence()
    seq.prefill([2] * (17 * 16 - 1))  # 17 blocks: the 16 free, then one cached block evicted
    del seq
    hits = model.cache_stats()["prefix_cache_hits"]
    seq = model.sequence()
    seq.prefill(prefix + [1])
    assert model.cache_stats()["prefix_cache_hits"] - hits == 7 * 16


def test_a_prompt_sent_right_after_itself_finds_its_prefix(path):
    """A prompt whose match stopped short (its sliding block evicted) computes its prefix again:
    the new copy is kept, and the prompt sent next finds it. (The old, unused copy had stayed
    cached at the LRU list's front, the new one uncached; the sequence's next block evicted the
    old: 0 hits for the next.)"""
    model = ds.Model.load(path, kv_block_size=16, kv_cache_memory_bytes=70448, max_num_seqs=5)
    assert model.cache_stats()["kv_blocks_total"] == 25  # 17 full-attention blocks and 8 sliding

    def hits(prompt, commits=0):
        before, seq = model.cache_stats()["prefix_cache_hits"], model.sequence()
        seq.prefill(prompt)
        for _ in range(commits):
            seq.commit(np.arange(CANVAS) + 40)
        return model.cache_stats()["prefix_cache_hits"] - before

    prompt = list(range(1, 29))  # a whole block and 12 tokens
    hits([50] * 32)
    hits(prompt)
    hits([60 + i % 3 for i in range(14 * 16)])  # fills the full pool: the prompt's sliding block evicted
    assert hits(prompt, commits=1) == 0  # its match stops short: its block computed again
    assert hits(prompt) == 16
    assert all_free(model.cache_stats())


def test_prefix_cache_hits_across_requests(make_llm):
    llm = make_llm()
    system = list(range(10, 10 + 5 * BLOCK))
    first = llm.generate([system + [1, 2, 3]], params(1))[0]
    second = llm.generate([system + [4, 5]], params(2))[0]
    stats = llm.stats()
    assert stats["prefix_cache_hits"] == len(system)
    assert stats["prefix_cache_queries"] == len(system) * 2 + 5
    cold = make_llm()
    assert second.token_ids == alone(cold, system + [4, 5], params(2)).token_ids
    assert first.token_ids == alone(cold, system + [1, 2, 3], params(1)).token_ids


def test_sliding_layers_stay_within_the_window(path):
    model = ds.Model.load(path, kv_block_size=BLOCK)
    seq = model.sequence()
    seq.prefill(list(range(50)))
    bound = -(-(WINDOW - 1) // BLOCK) + 1  # the window's blocks, one more when it straddles
    for block in range(20):
        seq.commit(list(range(CANVAS)))
        held = seq.kv_blocks()
        assert held["sliding"] <= bound
        assert held["full"] == -(-len(seq) // BLOCK)
    del seq
    assert all_free(model.cache_stats())


def test_window_far_past_the_sequence(tmp_path):
    """A sliding window longer than any sequence (2**31 - 1, which a config may give) asks no more
    KV than full attention: requests run, with the tokens of a window just past the sequence (every
    request had been refused as needing more KV than the whole cache holds)."""
    outs = []
    for window in (64, 2**31 - 1):
        path = write_random_checkpoint(tmp_path / str(window), canvas_length=CANVAS, seed=3,
                                       **{**SMALL, "sliding_window": window})
        llm = ds.LLM(path, kv_block_size=BLOCK, kv_cache_memory_bytes=1 << 20)
        outs.append(alone(llm, [5, 6, 7], params(0)).token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 24


def test_a_long_prompt_goes_on_in_every_pass_of_a_step(make_llm):
    """A step's later passes carry a prompt's next chunks in the rows that the running requests
    leave: a 400-token prompt beside a denoising request, 40 rows a pass, is encoded in 2 steps
    of 8 passes (it had taken 13, a chunk a step), and its output is the one it has alone."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 64, 400).tolist()
    p = params(2, n=CANVAS)
    llm = make_llm(max_num_batched_tokens=40, slice_steps=8)
    background = llm.add_request([1, 2, 3], ds.SamplingParams(max_new_tokens=CANVAS * 100, seed=1, eos_token_id=[],
                                                              max_denoising_steps=40, confidence_threshold=1e-30))
    llm.step()
    request, steps, done = llm.add_request(prompt, p), 0, []
    try:
        while not done:
            done = [out for out in llm.step() if out.request_id == request]
            steps += 1
    finally:
        llm.abort(background)  # (its KV freed whatever the outcome: the fixture checks it)
    assert steps <= 3
    assert done[0].token_ids == alone(make_llm(), prompt, p).token_ids


def test_a_cache_of_one_sliding_block_holds_a_sequence_of_one_block(path):
    """Blocks of 32 tokens in a cache that gives the sliding layers one: a sequence of one block
    fits it (each pool's block holds it), and generates as in a larger cache. The sliding
    layers had been counted one block more than any sequence fills, and the cache had held no
    sequence at all."""
    llm = ds.LLM(path, kv_block_size=32, kv_cache_memory_bytes=20_000)
    assert llm.model.max_sequence_tokens == 32
    p = params(0, n=CANVAS)
    roomy = ds.LLM(path, kv_block_size=32)
    assert llm.generate([[5, 6, 7]], p)[0].token_ids == roomy.generate([[5, 6, 7]], p)[0].token_ids
    with pytest.raises(ValueError, match="whose longest sequence is 32 tokens"):
        llm.generate([[5] * 30], p)


def test_preempted_requests_give_the_same_output(make_llm):
    rng = np.random.default_rng(1)
    prompts = [[i, *rng.integers(0, 64, int(n)).tolist()] for i, n in enumerate(rng.integers(4, 30, 8))]
    ps = [params(100 + i, n=32) for i in range(8)]
    # Room for about two long sequences at once: running ones must be preempted to commit.
    tight = make_llm(kv_cache_memory_bytes=60_000, max_num_seqs=8)
    outs = tight.generate(prompts, ps)
    stats = tight.stats()
    assert stats["preemptions"] > 0
    # Each prompt is looked up once, and none shares a first token with another: no hits (a
    # preempted request's own blocks, found again as it was admitted again, had counted).
    assert stats["prefix_cache_queries"] == sum(map(len, prompts)) and stats["prefix_cache_hits"] == 0
    ref = make_llm()
    for prompt, p, out in zip(prompts, ps, outs):
        assert out.token_ids == alone(ref, prompt, p).token_ids


def test_a_request_that_sits_a_pass_out_keeps_its_self_conditioning(make_llm):
    """Engine.step planned by hand: A and B (canvas 4, self-conditioned) denoise together while
    D (canvas 8, not self-conditioned) has no room in the 10 rows a pass; once A finishes, D
    takes 8 of them and B sits its passes out. Those passes had reused the previous pass's logits
    matrix in place (every request denoising in them had its feedback there, D having none), and
    written D's logits over B's feedback: B's tokens differed from B run alone."""
    llm = make_llm()
    defaults = llm.model._native.sampling_defaults()

    def one_block(seed, canvas, steps, **kw):
        return ds.SamplingParams(max_new_tokens=canvas, canvas_length=canvas, seed=seed, eos_token_id=[],
                                 max_denoising_steps=steps, confidence_threshold=1e-30, **kw)  # (every step runs)
    requests = {1: ([2, 3], one_block(11, 4, 3)), 2: ([4, 5], one_block(22, 4, 10)),
                3: ([6, 7], one_block(33, 8, 10, self_conditioning=False))}
    engine = ds._core.Engine(llm.model._native, True)
    for request_id, (prompt, p) in requests.items():
        engine.add(request_id, prompt, p._native(defaults))
        engine.admit(request_id, 100)
    done = {}
    while len(done) < len(requests):
        plan = [ds._core.StepPlan(request_id, 100) for request_id in (1, 3, 2) if request_id not in done]
        done.update((request_id, out.token_ids) for request_id, out in engine.step(plan, 100, 10))
    for request_id, (prompt, p) in requests.items():
        assert done[request_id] == alone(llm, prompt, p).token_ids, request_id


def test_many_requests_through_a_small_cache(make_llm):
    rng = np.random.default_rng(2)
    n = 120
    prompts = [rng.integers(0, 64, int(k)).tolist() for k in rng.integers(1, 40, n)]
    ps = [params(i, n=int(rng.integers(1, 25)), canvas_length=int(rng.choice([4, 8]))) for i in range(n)]
    llm = make_llm(kv_cache_memory_bytes=80_000, max_num_seqs=16, max_num_batched_tokens=48, slice_steps=3)
    outs = llm.generate(prompts, ps)
    ref = make_llm()
    for i in rng.choice(n, 30, replace=False):  # spot-check against each request alone
        assert outs[i].token_ids == alone(ref, prompts[i], ps[i]).token_ids
    assert all(len(o.token_ids) == p.max_new_tokens for o, p in zip(outs, ps))


def test_abort_frees_everything_at_once(make_llm):
    llm = make_llm(slice_steps=1)
    ids = [llm.add_request(list(range(3, 3 + 20 * k)), params(k, n=64)) for k in (1, 2, 3)]
    llm.step()
    assert llm.stats()["running"] == 3 and not all_free(llm.stats())
    for request_id in ids:
        llm.abort(request_id)
    assert all_free(llm.stats()) and not llm.has_unfinished()


def test_aborting_queued_requests_keeps_the_queues_order(make_llm):
    """Requests queued behind one slot, some aborted from the middle and the end of the queue
    (a dict now, where a deque was scanned): the rest run first come, first served, and
    nothing of the aborted ones stays."""
    llm = make_llm(max_num_seqs=1)
    ids = [llm.add_request([3 + k, 4, 5], params(k, n=8)) for k in range(6)]
    order = [out.request_id for out in llm.step()]
    for k in (2, 5, 3):
        llm.abort(ids[k])
    assert llm.stats()["waiting"] == 2
    while llm.has_unfinished():
        order += [out.request_id for out in llm.step()]
    assert order == [ids[0], ids[1], ids[4]] and all_free(llm.stats())


def test_requests_join_between_steps_and_wait_at_most_one_slice(make_llm):
    llm = make_llm(slice_steps=2)
    first = llm.add_request([1, 2, 3], params(1, n=40))
    llm.step()
    late = llm.add_request([4, 5, 6], params(2, n=8))
    llm.step()  # the next step admits it
    assert llm.stats()["running"] == 2
    done = {}
    while llm.has_unfinished():
        for out in llm.step():
            done[out.request_id] = out
    assert set(done) == {first, late}


def test_stats_and_limits(make_llm, path):
    llm = make_llm(max_num_seqs=2)
    for k in range(5):
        llm.add_request([1, 2, 3 + k], params(k, n=16))
    llm.step()
    stats = llm.stats()
    assert stats["running"] == 2 and stats["waiting"] == 3
    assert {"kv_blocks_total", "kv_blocks_free", "prefix_cache_hits", "prefix_cache_queries"} <= set(stats)
    while llm.has_unfinished():
        llm.step()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ds.LLM(path, max_num_batched_tokens=CANVAS - 1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        ds.LLM(path, max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        ds.LLM(path, kv_cache_memory_bytes=100)
    with pytest.raises(ValueError, match="KV"):  # a request bigger than the whole cache
        make_llm(kv_cache_memory_bytes=20_000).generate([[1] * 400], params(0, n=8))


@pytest.mark.parametrize("kv_bytes", [20_000, 60_000, 1 << 20])
def test_max_sequence_tokens_is_the_longest_request_taken(make_llm, kv_bytes):
    """Model.max_sequence_tokens (the server's max_model_len) is what one request can reach: a
    prompt and whole blocks that end there are taken, a block more is refused for the KV."""
    llm = make_llm(kv_cache_memory_bytes=kv_bytes)
    longest, canvas = llm.model.max_sequence_tokens, llm.model.canvas_length
    assert 0 < longest <= llm.model.config["max_position_embeddings"]
    prompt = [1] * (longest % canvas or canvas)
    fits = params(0, n=longest - len(prompt))
    llm.abort(llm.add_request(prompt, fits))
    # The refusal names the longest (as the positions' refusal names max_position_embeddings).
    with pytest.raises(ValueError, match=f"more than the whole cache holds, whose longest sequence is {longest} tokens"):
        llm.add_request(prompt, params(0, n=longest - len(prompt) + canvas))
    if longest + canvas <= llm.model.config["max_position_embeddings"]:  # (else the positions refuse it first)
        with pytest.raises(ValueError, match=f"need more KV than the whole cache holds, whose longest sequence is "
                                             f"{longest} "):
            llm.add_request([1] * longest, params(0, n=canvas))


def test_interrupt_ends_a_step_after_its_pass(make_llm):
    """LLM.interrupt (the server's aborts call it from the event loop) ends the step in
    progress after its pass instead of its slice, and the outputs do not change."""
    llm = make_llm(slice_steps=8)
    long = ds.SamplingParams(max_new_tokens=8, seed=0, max_denoising_steps=40, confidence_threshold=1e-30)
    request = llm.add_request([5, 6, 7], long)
    llm.step()  # the prompt, and the first steps of its block
    passes = llm.stats()["forward_passes"]
    llm.interrupt()
    llm.step()
    assert llm.stats()["forward_passes"] == passes + 1
    llm.step()  # the interrupt was for that step only
    assert llm.stats()["forward_passes"] > passes + 2
    llm.abort(request)

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 17, 40)]
    ps = [params(i, n=8 * (i + 1)) for i in range(3)]
    expected = make_llm().generate(prompts, ps)
    llm = make_llm(max_num_batched_tokens=24)
    ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, ps)]
    done = {}
    while llm.has_unfinished():
        llm.interrupt()  # every step one pass
        done.update((out.request_id, out) for out in llm.step())
    assert [done[i].token_ids for i in ids] == [e.token_ids for e in expected]
    assert [done[i].denoise_steps for i in ids] == [e.denoise_steps for e in expected]



def test_a_draft_holds_only_what_its_block_may_add(make_llm):
    """A draft is cut where max_new_tokens cuts the last block: the server's stream_drafts had
    shown a whole canvas where 2 of its tokens were to be kept."""
    llm = make_llm()
    p = ds.SamplingParams(max_new_tokens=CANVAS + 2, seed=0, eos_token_id=[], max_denoising_steps=40,
                          confidence_threshold=1e-30)
    request = llm.add_request([5, 6, 7], p)
    lengths = set()  # (tokens generated, draft length)
    while llm.has_unfinished():
        llm.interrupt()  # every step one pass
        if not llm.step():
            lengths.add((len(llm.generated(request)), len(llm.draft(request))))
    assert {(0, CANVAS), (CANVAS, 2)} <= lengths <= {(0, CANVAS), (CANVAS, 2), (0, 0), (CANVAS, 0)}


def test_an_abort_after_interrupt_waits_for_one_step_at_most(make_llm):
    """A thread that steps an LLM in a loop, and another that interrupts it to abort a request:
    the abort runs as soon as the interrupted step ends. The stepping thread had often taken
    the lock straight back (threading.RLock is not fair), and the abort waited a whole further
    step."""
    llm = make_llm(slice_steps=64)
    steps = [0]
    step = llm.step
    llm.step = lambda: (step(), steps.__setitem__(0, steps[0] + 1))[0]
    for trial in range(20):
        ids = [llm.add_request([2, 3], ds.SamplingParams(max_new_tokens=4096, seed=i, eos_token_id=[]))
               for i in range(4)]
        stop = threading.Event()

        def stepping():
            while not stop.is_set() and llm.has_unfinished():
                llm.step()

        thread = threading.Thread(target=stepping)
        thread.start()
        time.sleep(0.01)
        before = steps[0]
        llm.interrupt()
        llm.abort(ids[0])
        meanwhile = steps[0] - before
        stop.set()
        thread.join()
        for request in ids[1:]:
            llm.abort(request)
        assert meanwhile <= 1, f"try {trial}: {meanwhile} steps ran before the abort"


def test_a_signal_handler_may_call_the_llm_while_its_thread_waits_for_it(path):
    """A signal handler that calls the LLM (a watchdog reading stats()) runs within the main
    thread's wait for the LLM's lock, another thread holding it: the handler's call waits its
    turn too, and both return (with a non-reentrant turnstile the process had hung). In a
    subprocess, so that a regression fails rather than hangs."""
    script = """if True:
        import faulthandler, signal, sys, threading, time
        import diffuserve as ds
        llm = ds.LLM(sys.argv[1], kv_block_size=4)
        held = threading.Event()
        def holder():
            with llm._lock:
                held.set()
                time.sleep(0.3)
        threading.Thread(target=holder).start()
        held.wait()
        seen = []
        signal.signal(signal.SIGALRM, lambda signum, frame: seen.append(llm.stats()))
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        faulthandler.dump_traceback_later(60, exit=True)
        llm.stats()
        print(len(seen))
    """
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stdout + out.stderr


def test_a_cache_held_by_other_sequences_is_an_error_not_a_hang(make_llm):
    """A Sequence of the LLM's own model holding the cache: the request is never admitted (or
    is preempted), nothing of the engine's runs, and step() had returned nothing forever
    (generate hung). Now step() says why, the request stays queued, and it runs once the KV
    is released."""
    llm = make_llm(kv_cache_memory_bytes=40_000)
    seq = llm.model.sequence()
    for chunk in (256, 64, 16, 4, 1):  # hold every KV block there is
        while True:
            try:
                seq.prefill([3] * chunk)
            except ValueError:
                break
    request = llm.add_request([1, 2], params(0, n=8))
    message = (rf"request {request}: the KV cache has no room for its next 2 tokens while other sequences of this "
               "model hold the rest")
    with pytest.raises(ValueError, match=message):
        llm.step()
    assert llm.stats()["waiting"] == 1  # still queued
    llm.abort(request)
    with pytest.raises(ValueError, match="other sequences of this model hold the rest"):
        llm.generate([[1, 2]], params(0, n=8))
    assert not llm.has_unfinished()  # generate dropped its request
    request = llm.add_request([1, 2], params(0, n=8))
    del seq
    done = []
    while llm.has_unfinished():
        done += llm.step()
    assert [o.request_id for o in done] == [request]
    assert done[0].token_ids == alone(make_llm(), [1, 2], params(0, n=8)).token_ids


class _SigintAfterAStepThatFinishes:
    """The LLM's engine, sending SIGINT to this process as the first step that finishes a request
    returns: what a Ctrl-C during the C++ step does (Python raises it once the call is back)."""

    def __init__(self, engine):
        self.engine, self.armed = engine, True

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, *args):
        finished = self.engine.step(*args)
        if finished and self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return finished


@pytest.mark.parametrize("own_finishes", [False, True])
def test_ctrl_c_during_a_step_loses_no_output_and_leaves_the_llm_usable(make_llm, own_finishes):
    """A Ctrl-C during generate's step surfaces as KeyboardInterrupt, generate's requests are
    aborted, and another request's output that finished in that step still comes from a later
    step. It had surfaced mid-bookkeeping: the finished ids stayed `running` (every later step
    raised "no request with id N"), their outputs were lost, and generate's clean-up raised that
    ValueError in place of the interrupt, leaving a request holding KV."""
    llm = make_llm(slice_steps=1)
    side = llm.add_request([9, 9, 9], params(77, n=8))  # one block: the first to finish
    # own_finishes: one of generate's own requests finishes in that step as well.
    ps = [params(1, n=8 if own_finishes else 24), params(2, n=40)]
    llm.scheduler.engine = _SigintAfterAStepThatFinishes(llm.scheduler.engine)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5]], ps)
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [out.request_id for out in outs] == [side] and outs[0].token_ids == alone(
        make_llm(), [9, 9, 9], params(77, n=8)).token_ids
    assert llm.generate([[1, 2]], params(3, n=8))[0].finish_reason == "length"


class FailsAfterAFinish:
    """An engine whose first step that finishes a request then fails (MemoryError, as the C++
    step raises when the backend runs out of memory in a later pass), keeping the finished
    outputs for take_finished() as the C++ engine keeps them."""

    def __init__(self, engine):
        self.engine, self.armed, self.kept = engine, True, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, *args):
        finished = self.engine.step(*args)
        if finished and self.armed:
            self.armed, self.kept = False, finished
            raise MemoryError("out of memory allocating the logits")
        return finished

    def take_finished(self):
        kept, self.kept = self.kept, []
        return kept


def test_a_step_failing_after_requests_finished_keeps_their_outputs(make_llm):
    """A step that fails after requests finished in its earlier passes: their outputs come
    from the next step, the others go on (the finished ids had stayed `running`, and every
    later step raised "no request with id N")."""
    llm = make_llm(slice_steps=4)
    llm.scheduler.engine = FailsAfterAFinish(llm.scheduler.engine)
    prompts, ps = [[9, 9, 9], [1, 2, 3]], [params(77, n=8), params(1, n=40)]
    ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, ps)]
    outs = []
    with pytest.raises(MemoryError):
        while llm.has_unfinished():
            outs += llm.step()
    while llm.has_unfinished():
        outs += llm.step()
    assert [out.request_id for out in outs] == ids
    assert [out.token_ids for out in outs] == [alone(make_llm(), *a).token_ids for a in zip(prompts, ps)]


def test_a_failing_step_keeps_the_outputs_generate_held(make_llm):
    """An output of add_request's that a generate call held survives a step that fails (it
    had been dropped: never returned, though has_unfinished had said it was to come)."""
    llm = make_llm()
    side = llm.add_request([9, 9, 9], params(77, n=8))
    llm.generate([[1, 2, 3]], params(1, n=24))
    llm.scheduler.step = lambda: (_ for _ in ()).throw(ValueError("the step failed"))
    with pytest.raises(ValueError, match="the step failed"):
        llm.step()
    del llm.scheduler.step
    assert [out.request_id for out in llm.step()] == [side]


def test_abort_drops_an_output_generate_held(make_llm):
    """A request of add_request that a generate call ran to its end is held for the next step;
    aborting it drops that output (the step had still returned it)."""
    llm = make_llm()
    side = llm.add_request([9, 9, 9], params(77, n=8))
    llm.generate([[1, 2, 3]], params(1, n=24))
    assert llm.has_unfinished()
    llm.abort(side)
    assert not llm.has_unfinished() and llm.step() == []


def test_a_long_prompt_prefills_in_chunks_the_sliding_pool_takes(path):
    """Sequence.prefill of a prompt longer than the sliding-window layers' pool takes at once
    (a window and a chunk a sequence) encodes it in chunks, as the engine does: the same KV and
    logits as a chunked prefill by hand. It had been refused, advising more memory that did not
    help, with nearly every block free."""
    model = ds.Model.load(path, kv_cache_memory_bytes=64 << 20, kv_block_size=BLOCK, max_num_seqs=2)
    prompt = (np.arange(3000) * 7 % 64).tolist()
    whole, by_hand = model.sequence(), model.sequence()
    whole.prefill(prompt)
    for start in range(0, len(prompt), 10):
        by_hand.prefill(prompt[start:start + 10])
    assert len(whole) == len(by_hand) == 3000
    for layer in range(3):
        np.testing.assert_allclose(whole.kv(layer)[0], by_hand.kv(layer)[0], atol=1e-5)
    canvas = np.arange(CANVAS)
    np.testing.assert_allclose(whole.denoise(canvas), by_hand.denoise(canvas), atol=1e-4)


def test_a_long_later_prefill_goes_in_chunks_too(path):
    """A prefill after the first, longer than the sliding pool takes at once, is chunked as a
    first one is (it had been refused, with nearly every block free, where the same tokens in
    the first prefill went through); one the cache has no room for is refused whole, the
    sequence as it was."""
    model = ds.Model.load(path, kv_cache_memory_bytes=64 << 20, kv_block_size=BLOCK, max_num_seqs=2)
    prompt = (np.arange(3000) * 7 % 64).tolist()
    whole, continued = model.sequence(), model.sequence()
    whole.prefill(prompt)
    continued.prefill(prompt[:1])
    continued.prefill(prompt[1:])
    assert len(continued) == 3000
    for layer in range(3):
        np.testing.assert_allclose(whole.kv(layer)[0], continued.kv(layer)[0], atol=1e-5)
    del whole, continued
    small = ds.Model.load(path, kv_cache_memory_bytes=24 << 10, kv_block_size=4, max_num_seqs=2)
    seq = small.sequence()
    seq.prefill(prompt[:8])
    with pytest.raises(ValueError, match=r"prefill: the KV cache has no room for 300 more tokens"):
        seq.prefill(prompt[:300])
    assert len(seq) == 8
    # Window blocks shared with another sequence through the prefix cache are not freed as the
    # chunks pass them (a review found the check counting them, and the prefill failing halfway).
    del seq
    model = ds.Model.load(path, kv_cache_memory_bytes=64 << 20, kv_block_size=4, max_num_seqs=2)
    first, second = (np.arange(40) * 7 % 64).tolist(), (np.arange(98) * 5 % 64).tolist()
    a, b = model.sequence(), model.sequence()
    a.prefill(first)
    b.prefill(first)  # takes a's blocks
    try:
        b.prefill(second)
        assert len(b) == 138
    except ValueError as e:
        assert "no room" in str(e) and len(b) == 40


def test_a_prompt_past_the_whole_cache_is_named(path):
    """Sequence.prefill of a prompt no chunking fits names the prompt's tokens and the whole
    cache (it had said "no room for 1 more tokens": the size of the last chunk it tried), and
    leaves the sequence empty."""
    model = ds.Model.load(path, kv_cache_memory_bytes=24 << 10, kv_block_size=4, max_num_seqs=2)
    seq = model.sequence()
    with pytest.raises(ValueError, match=r"prefill: 300 tokens need more KV than the whole cache holds"):
        seq.prefill([i % 64 for i in range(300)])
    assert len(seq) == 0


def test_more_live_sequences_than_max_num_seqs_name_it(path):
    """The sliding-window layers keep room for max_num_seqs sequences' windows: a sequence past
    them is refused naming max_num_seqs (the message had advised only more memory)."""
    model = ds.Model.load(path, kv_cache_memory_bytes=64 << 20, kv_block_size=BLOCK, max_num_seqs=1)
    live = []
    with pytest.raises(ValueError, match=r"prefill: the KV cache has no room for 10 more tokens .*max_num_seqs"):
        for i in range(64):
            live.append(model.sequence())
            live[-1].prefill([(10 * i + j) % 64 for j in range(10)])  # no prefix shared


def test_ids_are_read_from_a_copy_checked_once(path):
    """The ids (and self-conditioning logits) a sequence reads are a copy, checked once: another
    thread writing into the caller's array after the check had sent an out-of-range id past the
    embedding (a segfault)."""
    from diffuserve._checks import check_token_ids
    ids = np.arange(5, dtype=np.int32)
    checked = check_token_ids(ids, "prefill", 64)
    ids[0] = 2**30
    assert checked[0] == 0 and not np.shares_memory(ids, checked)


def test_a_signal_at_any_line_of_a_step_loses_no_output(make_llm):
    """A signal handler's exception (a timeout's) at each line of a step that finishes a
    request: the output comes out once, from that step or the next. (Filed once the step's
    bookkeeping was done, a signal then had thrown them away.)"""
    class Timeout(Exception):
        pass

    code = ds.llm.LLM._step_for.__code__
    lines = sorted({line for _, _, line in code.co_lines() if line and line > code.co_firstlineno})
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: (_ for _ in ()).throw(Timeout()))
    try:
        for line in lines:
            llm = make_llm(slice_steps=1)
            request_id, outs, fired = llm.add_request([5, 6], params(0, n=8)), [], []

            def on_line(frame, event, arg):
                if event == "line" and frame.f_lineno == line and not fired and frame.f_locals.get("outputs"):
                    fired.append(line)
                    signal.raise_signal(signal.SIGALRM)
                return on_line

            sys.settrace(lambda frame, event, arg: on_line if frame.f_code is code else None)
            try:
                while llm.has_unfinished():
                    try:
                        outs += llm.step()
                    except Timeout:
                        pass
            finally:
                sys.settrace(None)
            assert [out.request_id for out in outs] == [request_id], (line, fired)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_signal_handlers_exception_at_any_moment_leaves_the_llm_consistent(make_llm):
    """A signal handler's exception (a timeout's, at SIGALRM) raised at random moments of
    generate, add_request and step surfaces as itself once the LLM's bookkeeping is done:
    generate's requests are aborted, every other request's output comes out exactly once, and
    the LLM serves on. (Only SIGINT had been held back: generate's clean-up had raised "no
    request with id N" in place of the timeout, and an admission cut short had wedged every
    later step on "request 0 is already running".)"""
    import os
    import random

    class Timeout(Exception):
        pass

    package = os.path.dirname(ds.__file__)

    # In diffuserve's code alone, the test's own lines are not what is tested; nor the locking
    # wrapper of the LLM's methods (`run`), whose every line past the lock's release is as the
    # caller's own after the call: a value returned is lost there as in any Python call.
    def on_alarm(signum, frame):
        if frame.f_code.co_filename.startswith(package) and frame.f_code is not ds.LLM.step.__code__:
            raise Timeout()

    def timed(call):
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 3e-3))
        try:
            return call()
        except Timeout:
            return None

    llm, rng = make_llm(slice_steps=1), random.Random(0)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        for trial in range(120):
            timed(lambda: llm.generate([[2, 3, 4 + i] for i in range(3)], params(trial, n=8)))
            ids = [timed(lambda: llm.add_request([5, 6 + i], params(trial + i, n=8))) for i in range(3)]
            outs = []
            while timed(llm.has_unfinished) is not False:
                outs += timed(llm.step) or []
            assert sorted(out.request_id for out in outs) == [i for i in ids if i is not None], trial
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    expected = alone(make_llm(), [1, 2], params(0, n=8)).token_ids
    assert alone(llm, [1, 2], params(0, n=8)).token_ids == expected


def test_an_engine_call_that_waits_for_the_models_turn_lets_python_run(tmp_path):
    """LLM calls wait for the model's turn, which another thread's pass may hold for seconds (a
    Sequence of llm.model, here a long prefill): they wait without the GIL, so that other
    Python threads (an event loop) run meanwhile. They had held it, stopping every Python
    thread until the pass ended."""
    path = write_random_checkpoint(tmp_path / "m", canvas_length=16, seed=1)
    llm = ds.LLM(path, num_threads=1)
    seq = llm.model.sequence()
    passing, passed, waiting = threading.Event(), threading.Event(), threading.Event()

    def long_pass():  # about a second on one core
        passing.set()
        seq.prefill(np.arange(6000) % 500)
        passed.set()

    refused = []

    def wait_for_the_turn():
        passing.wait()
        time.sleep(0.1)  # (the pass under way)
        waiting.set()
        try:
            llm.generated(7)  # no such request: refused once the turn comes
        except ValueError as e:
            refused.append(e)

    threads = [threading.Thread(target=long_pass), threading.Thread(target=wait_for_the_turn)]
    for t in threads:
        t.start()
    waiting.wait()
    time.sleep(0.2)  # back only once some thread lets go of the GIL
    ran_during_the_pass = not passed.is_set() and not refused
    for t in threads:
        t.join()
    assert ran_during_the_pass and refused
