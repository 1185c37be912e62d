"""The sequence groups the scheduler and KV-manager tests build by hand (one definition, used by every test module
that needs one): ``make_group`` and ``admit``. Imported by test modules (``from seq_groups import
make_group``); not a test module."""
from __future__ import annotations

from typing import Iterable

from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup


def make_group(request_id: str, seq_ids: Iterable[int], prompt: int | list[int], arrival_time: float = 0.0,
               **params) -> SequenceGroup:
    """A group of one sequence per id of ``seq_ids``, each with ``prompt``'s token ids (an int: that many 1s),
    decoded with ``SamplingParams(**params)``."""
    ids = [1] * prompt if isinstance(prompt, int) else prompt
    return SequenceGroup(request_id, [Sequence(i, list(ids)) for i in seq_ids], SamplingParams(**params),
                         arrival_time)


def admit(kv, g: SequenceGroup) -> int:
    """Allocate a waiting group's blocks in ``kv`` and mark it running, as the scheduler does; returns the prompt
    tokens found cached."""
    cached = kv.allocate_group(g)
    g.set_status("waiting", "running")
    return cached
