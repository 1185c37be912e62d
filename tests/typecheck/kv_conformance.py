"""Static conformance of the two KV managers to the ``KVManager`` protocol (``memory/interface.py``), checked by mypy in
``make check`` (so in CI): every method with its signature, not only its name (``tests/test_kv_interface.py`` checks
the behaviour). A manager that drops a method or changes a signature fails the type check. Not a pytest module."""
from pagedattn.memory.block_manager import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager
from pagedattn.memory.interface import KVDecodeRuns, KVManager

paged: KVManager = BlockManager(block_size=16, num_gpu_blocks=8)
orca: KVManager = ContiguousKVManager(128, "oracle")
# the simulator's extension (``repro.sim.runs``)
paged_runs: KVDecodeRuns = BlockManager(block_size=16, num_gpu_blocks=8)
orca_runs: KVDecodeRuns = ContiguousKVManager(128, "oracle")
