"""The KV-manager interface (``memory.interface.KVManager``): both managers implement it, and what the scheduler,
engine and runner ask through it agrees with each manager's own bookkeeping (paper §4.2-§4.5, Orca §2.3)."""
import pytest

from pagedattn.memory import AllocStatus, KVManager
from pagedattn.memory.interface import KVAllocator, KVInspector, KVLayout, copy_pairs, num_copied
from pagedattn.sequence import SequenceGroup
from factories import block_manager, contiguous_manager
from seq_groups import admit, make_group

#: every member of the three views that make up ``KVManager`` (the scheduler's, the executor's, the inspector's)
VIEWS = (KVAllocator, KVLayout, KVInspector)
MEMBERS = sorted({n for view in VIEWS for n in [*vars(view), *view.__annotations__] if not n.startswith("_")})


def group(rid: str, seq_ids: list[int], prompt_len: int, max_tokens: int = 8) -> SequenceGroup:
    return make_group(rid, seq_ids, list(range(1, prompt_len + 1)), n=len(seq_ids), max_tokens=max_tokens)


@pytest.mark.parametrize("kv", [block_manager(4, 16), contiguous_manager(64, "oracle", max_model_len=64)])
def test_both_managers_implement_every_member(kv):
    assert "block_size" in MEMBERS and "never_reason" in MEMBERS and "slot_mapping" in MEMBERS and \
        "pool_counts" in MEMBERS and all(view in KVManager.__mro__ for view in VIEWS)
    missing = [n for n in MEMBERS if not hasattr(kv, n)]
    assert not missing


@pytest.mark.parametrize("kv", [block_manager(4, 16), contiguous_manager(64, "oracle", max_model_len=64)])
def test_slots_tables_and_location_agree(kv):
    g = group("r", [0], 6)
    assert kv.location(0) is None
    assert admit(kv, g) == 0  # nothing cached without prefix caching
    assert kv.location(0) == ("gpu", 6) and kv.num_tokens(0) == 6
    bs = kv.cache_layout()[1]
    table = kv.block_table(0)
    assert kv.slot_mapping(0, 0, 6) == [table[p // bs] * bs + p % bs for p in range(6)]
    # the context's blocks only: paged (4 tokens a block) 2 blocks for 6 tokens, 1 for 4; Orca's reservation (one
    # slot a "block", 6 + 8 reserved) 6 and 4 of its 14
    assert len(table) == (2 if bs == 4 else 14)
    for n, want in ((6, 2 if bs == 4 else 6), (5, 2 if bs == 4 else 5), (4, 1 if bs == 4 else 4)):
        assert kv.block_table(0, n) == table[:want]
    assert kv.num_filled_slots() == 6 and kv.num_used_gpu_blocks >= 6 // bs
    kv.free_seq(g.seqs[0])
    assert kv.location(0) is None and kv.num_used_gpu_blocks == 0
    kv.check_invariants()


def test_fork_into_shares_blocks_when_paged_and_copies_slots_when_contiguous():
    paged = block_manager(4, 16)
    admit(paged, group("r", [0, 1], 6))
    assert paged.fork_into(0, 1) == [] and paged.block_table(1) == paged.block_table(0)
    paged.check_invariants()
    orca = contiguous_manager(64, "oracle", max_model_len=64)
    g = group("r", [0, 1], 6)
    admit(orca, g)
    copies = orca.fork_into(0, 1)
    assert copy_pairs(copies) == list(zip(orca.block_table(0)[:6], orca.block_table(1)[:6]))
    assert copies == [(orca.block_table(0)[0], orca.block_table(1)[0], 6)] and orca.num_tokens(1) == 6
    assert num_copied(copies) == 6


def test_copy_runs_expand_to_one_pair_per_block():
    assert copy_pairs([(3, 7, 1), (10, 20, 3)]) == [(3, 7), (10, 20), (11, 21), (12, 22)]
    assert num_copied([(3, 7, 1), (10, 20, 3)]) == 4 and copy_pairs([]) == [] and num_copied([]) == 0


def test_never_reason_names_the_limit():
    paged = block_manager(4, 4, max_model_len=64)
    big = group("big", [0], 20)
    assert paged.can_allocate(big) is AllocStatus.NEVER
    assert "num_gpu_blocks=4" in paged.never_reason(big)
    orca = contiguous_manager(16, "max", max_model_len=64)
    assert orca.can_allocate(group("o", [1], 4)) is AllocStatus.NEVER
    assert "arena of 16 slots" in orca.never_reason(group("o", [1], 4))


def test_beam_worst_case_is_checked_by_the_paged_manager_only():
    with pytest.raises(ValueError, match="beam search may need 9 blocks of 4, but the pool has only "
                                         r"num_gpu_blocks=8 \(0 kept free\)"):
        block_manager(4, 8).check_group_blocks(9, "beam search")
    contiguous_manager(16, "oracle").check_group_blocks(10 ** 6, "beam search")  # admission checks reservations


def test_contiguous_manager_never_swaps():
    orca = contiguous_manager(64, "oracle", max_model_len=64)
    g = group("r", [0], 4)
    admit(orca, g)
    assert not orca.can_swap_out(g) and orca.cache_layout() == (64, 1, 0)
    with pytest.raises(ValueError, match="no CPU pool"):
        orca.swap_out_group(g)
    assert orca.swap_in_status(g) is AllocStatus.NEVER and not orca.can_swap_in_group(g)


#: what ``BlockManager`` shows beside the protocols (issue 63: one public API): read-only counters that the reports
#: and tests read (the pools' sizes, Fig. 15's logical blocks, the prefix hit rate) and the state that ``paged_stats``
#: and ``check_invariants`` walk (tests read it only through the inspector: ``test_test_hygiene.py``). A mutation of
#: one sequence belongs to the manager's private steps, which tests and the tour call through ``PerSequence``.
PAGED_INSPECTION = {"num_gpu_blocks", "num_free_gpu_blocks", "num_logical_blocks", "prefix_hit_rate",
                    "max_model_len", "watermark_blocks", "enable_prefix_caching", "gpu", "cpu", "tables", "pinned",
                    "prefix_queries", "prefix_hits"}
#: the per-sequence steps (§4.2-§4.5) and their checks, ``PerSequence``'s calls
PER_SEQUENCE = {"allocate", "fork", "append_slot", "free", "swap_out", "swap_in", "can_allocate_tokens",
                "check_request", "needs_new_block", "next_token_blocks", "slot"}


def test_the_paged_manager_has_one_public_api_the_protocols():
    """``BlockManager``'s public members are the protocols' (``KVManager``'s three views and the simulator's
    ``KVDecodeRuns``) and the declared inspection members, nothing else: a public per-sequence mutator added to it
    again fails here. Its per-sequence steps are reached through ``memory.per_sequence.PerSequence`` alone."""
    from pagedattn.memory.block_manager import BlockManager
    from pagedattn.memory.interface import KVDecodeRuns
    from pagedattn.memory.per_sequence import PerSequence

    kv = block_manager(4, 16)
    public = {n for n in [*dir(BlockManager), *vars(kv)] if not n.startswith("_")}
    protocols = set(MEMBERS) | {n for n in vars(KVDecodeRuns) if not n.startswith("_")}
    assert protocols <= public and public - protocols == PAGED_INSPECTION
    assert not public & PER_SEQUENCE
    assert {n for n in dir(PerSequence) if not n.startswith("_")} == PER_SEQUENCE
    per_seq = PerSequence(kv)
    per_seq.allocate(0, 6)
    per_seq.fork(0, 1)
    assert per_seq.append_slot(1) == (1, 2) and per_seq.slot(1, 6) == 2 * 4 + 2
    per_seq.free(0)
    per_seq.free(1)
    assert kv.seq_ids() == [] and kv.num_used_gpu_blocks == 0
