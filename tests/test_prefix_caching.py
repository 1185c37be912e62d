"""Prefix caching in the block manager: hits on shared prefixes, LRU eviction of unreferenced blocks only, and a
shadow-memory property test that no sequence ever reads another prefix's K/V, also across swapping; blocks are
identified by collision-resistant digests (prompts whose Python hashes collide never share a block)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedattn.memory import AllocStatus
from pagedattn.memory.block_manager import block_hashes
from pagedattn.memory.per_sequence import PerSequence
from factories import block_manager


def test_shared_prefix_hits_and_keeps_the_last_token_to_compute():
    m = block_manager(block_size=4, num_gpu_blocks=16, watermark=0.0, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    prefix = [7, 7, 8, 8, 9, 9, 1, 2]  # two full blocks
    assert per_seq.allocate(0, 11, prefix + [3, 4, 5]) == 0  # cold: computes everything
    assert per_seq.allocate(1, 10, prefix + [6, 6]) == 8  # both prefix blocks hit
    assert m.block_table(1)[:2] == m.block_table(0)[:2] and m.block_view().ref_counts[m.block_table(0)[0]] == 2
    assert per_seq.allocate(2, 8, prefix) == 4  # identical prompt: the last block is recomputed, not shared
    assert m.block_table(2)[1] != m.block_table(0)[1]
    c = m.pool_counts()
    assert (c.prefix_hits, c.prefix_queries) == (3, 6)
    m.check_invariants()


def test_freed_blocks_stay_cached_until_evicted_lru():
    m = block_manager(block_size=2, num_gpu_blocks=4, watermark=0.0, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    per_seq.allocate(0, 5, [1, 1, 2, 2, 3])
    per_seq.free(0)
    assert m.num_free_gpu_blocks == 4 and len(m.block_view().cached) == 2  # two full blocks kept, free but cached
    assert per_seq.allocate(1, 5, [1, 1, 2, 2, 9]) == 4  # revived from the evictable list
    per_seq.free(1)
    per_seq.allocate(2, 8, [5] * 8)  # needs all four blocks: evicts the cached ones, least recent first
    assert m.pool_counts().gpu_evictions == 2 and len(m.block_view().cached) == 4  # its own four full blocks
    m.check_invariants()


def test_appended_full_blocks_become_cached():
    m = block_manager(block_size=2, num_gpu_blocks=8, watermark=0.0, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    tokens = [1, 2, 3]
    per_seq.allocate(0, 3, tokens)
    tokens.append(4)
    per_seq.append_slot(0, tokens)
    assert len(m.prefix_digests(0)) == 2 and m.block_table(0)[1] in m.block_view().digests
    assert per_seq.allocate(1, 5, [1, 2, 3, 4, 0]) == 4


def test_user_marked_prefix_is_pinned_without_automatic_caching():
    m = block_manager(block_size=4, num_gpu_blocks=16, watermark=0.0)
    per_seq = PerSequence(m)
    prefix = list(range(10, 18))
    assert per_seq.allocate(0, 10, prefix + [1, 2], prefix_len=8) == 0
    per_seq.free(0)
    assert m.num_used_gpu_blocks == 2  # the marked prefix stays, pinned
    assert per_seq.allocate(1, 9, prefix + [5], prefix_len=8) == 8
    assert per_seq.allocate(2, 12, [1] * 12) == 0 and len(m.block_view().cached) == 2  # nothing else is cached
    assert per_seq.can_allocate_tokens(9, prefix + [6], prefix_len=8) is AllocStatus.OK
    m.check_invariants()


def test_request_that_fits_only_without_the_pinned_prefixes_is_refused():
    """User-marked prefixes are held for good, so a request that needs more than the rest of the pool can never run:
    it is refused (NEVER, a ValueError naming the limit), not left waiting; one that shares the prefix still fits."""
    m = block_manager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    per_seq = PerSequence(m)
    prefix = list(range(10, 22))
    per_seq.allocate(0, 13, prefix + [1], prefix_len=12)  # pins 3 blocks
    per_seq.free(0)
    assert per_seq.can_allocate_tokens(30, list(range(100, 130))) is AllocStatus.NEVER  # 8 blocks, 3 of 8 pinned
    with pytest.raises(ValueError, match="3 of the pool's num_gpu_blocks=8 hold user-marked prefixes"):
        per_seq.check_request(30, list(range(100, 130)))
    assert per_seq.can_allocate_tokens(20, list(range(100, 120))) is AllocStatus.OK  # 5 blocks
    assert per_seq.can_allocate_tokens(30, prefix + list(range(18)), prefix_len=12) is AllocStatus.OK  # shares all 3


@pytest.mark.parametrize("a,b", [(-1, -2), (0, 2**61 - 1)])
def test_prompts_whose_python_hashes_collide_do_not_share_blocks(a, b):
    """Issue 12 (7): blocks are identified by a BLAKE2b digest, not Python's ``hash``, under which these token
    tuples collide (CPython: ``hash(-1) == hash(-2)``, and integers hash modulo 2**61 - 1); a crafted prompt must not
    read another request's K/V."""
    bs = 4
    assert hash((None, (a,) * bs)) == hash((None, (b,) * bs))  # the collision the old identity had
    m = block_manager(block_size=bs, num_gpu_blocks=8, watermark=0.0, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    assert per_seq.allocate(0, bs + 1, [a] * bs + [7]) == 0
    assert per_seq.allocate(1, bs + 1, [b] * bs + [7]) == 0  # nothing cached for it: computed, not read from seq 0
    assert m.block_table(0)[0] != m.block_table(1)[0]
    assert per_seq.allocate(2, bs + 1, [a] * bs + [9]) == bs  # the same prefix still hits
    m.check_invariants()


TOKENS = st.sampled_from([-2, -1, 0, 1, 2, 2**61 - 1, 2**61, 2**62])  # values whose Python hashes collide


@settings(max_examples=200, deadline=None)
@given(bs=st.integers(1, 4), x=st.lists(TOKENS, min_size=1, max_size=12), y=st.lists(TOKENS, min_size=1, max_size=12))
def test_two_prompts_share_a_block_only_if_their_prefixes_are_equal(bs, x, y):
    """Digests: equal exactly when the whole token prefix up to the end of the block is equal; in the manager, the
    second prompt maps to the first one's block ``i`` only then."""
    hx, hy = block_hashes(x, bs, len(x) // bs), block_hashes(y, bs, len(y) // bs)
    for i, (u, v) in enumerate(zip(hx, hy)):
        assert (u == v) == (x[:(i + 1) * bs] == y[:(i + 1) * bs])
    m = block_manager(block_size=bs, num_gpu_blocks=24, watermark=0.0, enable_prefix_caching=True)
    per_seq = PerSequence(m)
    per_seq.allocate(0, len(x), x)
    per_seq.allocate(1, len(y), y)
    for i, (u, v) in enumerate(zip(m.block_table(0), m.block_table(1))):
        if u == v:
            assert x[:(i + 1) * bs] == y[:(i + 1) * bs]


class CachingMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / swap-out / swap-in with prefix caching (automatic, or a user-marked
    prefix) over a tiny alphabet (so prefixes collide). A shadow memory records which token each physical slot of
    each pool holds, and block moves copy it; every table must read its own tokens, also after its blocks were
    swapped together with other tables' (a block shared between them is moved once, §4.5)."""

    BS = 2

    @initialize(automatic=st.booleans())
    def make_manager(self, automatic):
        self.m = block_manager(block_size=self.BS, num_gpu_blocks=14, num_cpu_blocks=10, watermark=0.0,
                               enable_prefix_caching=automatic)
        self.per_seq = PerSequence(self.m)
        self.tokens: dict[int, list[int]] = {}
        self.content: dict[tuple[str, int], dict[int, int]] = {}  # (pool, block) -> {offset: token}
        self.next_id = 0

    def _on(self, device):
        return [s for s in self.m.seq_ids() if self.m.location(s)[0] == device]

    def _write(self, seq, lo, hi):
        blocks = self.m.block_table(seq)
        for p in range(lo, hi):
            self.content.setdefault(("gpu", blocks[p // self.BS]), {})[p % self.BS] = self.tokens[seq][p]

    @rule(prompt=st.lists(st.integers(1, 2), min_size=1, max_size=9), prefix_len=st.integers(0, 6))
    def allocate(self, prompt, prefix_len):
        if self.per_seq.can_allocate_tokens(len(prompt), prompt, prefix_len) is not AllocStatus.OK:
            return
        referenced = {b for b, c in enumerate(self.m.block_view().ref_counts) if c > 0}
        cached = self.per_seq.allocate(self.next_id, len(prompt), prompt, prefix_len)
        for b in self.m.block_table(self.next_id)[cached // self.BS:]:
            assert b not in referenced, "a referenced block was handed out (evicted?)"
        self.tokens[self.next_id] = list(prompt)
        self._write(self.next_id, cached, len(prompt))  # only the uncached part is computed
        self.next_id += 1

    @precondition(lambda self: self._on("gpu"))
    @rule(data=st.data(), tok=st.integers(1, 2))
    def append(self, data, tok):
        s = data.draw(st.sampled_from(self._on("gpu")))
        if self.per_seq.needs_new_block(s) and self.m.num_free_gpu_blocks == 0:
            return
        self.tokens[s].append(tok)
        copy = self.per_seq.append_slot(s, self.tokens[s])
        if copy:
            self.content[("gpu", copy[1])] = dict(self.content.get(("gpu", copy[0]), {}))
        n = len(self.tokens[s])
        self._write(s, n - 1, n)

    @precondition(lambda self: self._on("gpu"))
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self._on("gpu")))
        self.per_seq.fork(s, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[s])
        self.next_id += 1

    @precondition(lambda self: self.m.seq_ids())
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.m.seq_ids()))
        self.per_seq.free(s)
        del self.tokens[s]

    def _move(self, data, src, dst):
        seqs = data.draw(st.lists(st.sampled_from(self._on(src)), min_size=1, max_size=3, unique=True))
        try:
            copies = (self.per_seq.swap_out if dst == "cpu" else self.per_seq.swap_in)(seqs)
        except ValueError:  # the destination pool is full
            return
        for a, b in copies.items():
            self.content[(dst, b)] = dict(self.content.get((src, a), {}))

    @precondition(lambda self: self._on("gpu"))
    @rule(data=st.data())
    def swap_out(self, data):
        self._move(data, "gpu", "cpu")

    @precondition(lambda self: self._on("cpu"))
    @rule(data=st.data())
    def swap_in(self, data):
        self._move(data, "cpu", "gpu")

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        self.m.check_invariants()
        for s, toks in self.tokens.items():
            pool, blocks = self.m.location(s)[0], self.m.block_table(s)
            got = [self.content.get((pool, blocks[p // self.BS]), {}).get(p % self.BS) for p in range(len(toks))]
            assert got == toks, f"sequence {s} would read {got}, wrote {toks}"

    def teardown(self):
        for s in self.m.seq_ids():
            self.per_seq.free(s)
        c, view = self.m.pool_counts(), self.m.block_view()
        assert c.gpu_free == c.gpu_blocks - len(view.pinned)
        assert c.cpu_free == c.cpu_blocks
        assert all(n == (b in view.pinned) for b, n in enumerate(view.ref_counts))


TestCachingMachine = CachingMachine.TestCase
TestCachingMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
