"""The NVMe tier's compact index against a dict model (hypothesis state machine), plus its
memory bound and the sizes it keeps for the checkpoint reservation."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv.formats.value import ObjectMeta, ValueKind
from tierkv.tiers.nvme._index import Location, NvmeIndex
from tierkv.tiers.nvme._reserve import meta_weight

UNIT = 4096
_Record = tuple[int, int, int, ObjectMeta, int]  # region, offset, length, meta, hits

# few distinct keys so puts overwrite and deletes hit; lengths vary so the arena compacts
KEYS = st.sampled_from([bytes([i]) * n for i in range(12) for n in (1, 33, 200)])
METAS = st.sampled_from([
    ObjectMeta(ValueKind.BYTES, "", (), 100, 1),
    ObjectMeta(ValueKind.BYTES, "", (), 0, 7, (b"parent",)),
    ObjectMeta(ValueKind.TENSOR, "float16", (2, 3), 12, 2**40),
])


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = NvmeIndex(UNIT, initial_table=4, compact_min=64, weigh=meta_weight)
        self.model: dict[bytes, _Record] = {}

    @rule(key=KEYS, region=st.integers(0, 5), block=st.integers(0, 2**20),
          blocks=st.integers(1, 8), meta=METAS, hits=st.integers(0, 70000))
    def put(self, key: bytes, region: int, block: int, *, blocks: int, meta: ObjectMeta,
            hits: int) -> None:
        old = self.index.put(key, region=region, offset=block * UNIT, length=blocks * UNIT,
                             meta=meta, hits=hits)
        self._check_location(key, old)
        self.model[key] = (region, block * UNIT, blocks * UNIT, meta, min(hits, 0xFFFF))

    @rule(key=KEYS)
    def remove(self, key: bytes) -> None:
        self._check_location(key, self.index.remove(key))
        self.model.pop(key, None)

    @rule(key=KEYS)
    def touch(self, key: bytes) -> None:
        self.index.touch(key)
        if key in self.model:
            region, offset, length, meta, hits = self.model[key]
            self.model[key] = (region, offset, length, meta, min(hits + 1, 0xFFFF))

    @rule(key=KEYS)
    def lookup(self, key: bytes) -> None:
        self._check_location(key, self.index.get(key))
        assert (key in self.index) == (key in self.model)
        record = self.model.get(key)
        assert self.index.meta(key) == (record[3] if record else None)

    @rule(region=st.integers(0, 5))
    def region_keys(self, region: int) -> None:
        expected = {k for k, r in self.model.items() if r[0] == region}
        found = self.index.keys_in_region(region)
        assert len(found) == len(set(found)) and set(found) == expected

    @precondition(lambda self: len(self.model) > 4)
    @rule()
    def remove_most(self) -> None:
        for key in list(self.model)[1:]:
            self.remove(key)

    @invariant()
    def same_keys(self) -> None:
        assert len(self.index) == len(self.model)
        assert sorted(self.index.keys()) == sorted(self.model)

    @invariant()
    def same_sizes(self) -> None:
        """The running sums the checkpoint reservation reads follow every put and remove."""
        assert self.index.key_bytes == sum(len(k) for k in self.model)
        metas = [record[3] for record in self.model.values()]
        assert self.index.meta_bytes == sum(meta_weight(m.dtype, m.shape, m.parents)
                                            for m in metas)
        for meta in metas:
            assert self.index.weight(meta) == meta_weight(meta.dtype, meta.shape, meta.parents)

    def _check_location(self, key: bytes, found: Location | None) -> None:
        record = self.model.get(key)
        if record is None:
            assert found is None
            return
        region, offset, length, meta, hits = record
        assert found == Location(region, offset, length, meta.generation, hits)


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60,
                                          deadline=None)
TestIndexMachine = IndexMachine.TestCase


def test_growth_and_churn_keep_every_key() -> None:
    index = NvmeIndex(UNIT, initial_table=2, compact_min=1000)
    meta = ObjectMeta(ValueKind.BYTES, "", (), 10, 3)
    keys = [b"k%06d" % i for i in range(20000)]
    for i, key in enumerate(keys):
        index.put(key, region=i % 7, offset=i * UNIT, length=UNIT, meta=meta)
    for key in keys[::2]:
        assert index.remove(key) is not None
    for i, key in enumerate(keys[1::2]):
        loc = index.get(key)
        assert loc is not None and loc.offset == (2 * i + 1) * UNIT
    assert not any(key in index for key in keys[::2])
    assert len(index) == len(keys) // 2


def test_memory_per_entry_is_bounded() -> None:
    index = NvmeIndex(UNIT)
    meta = ObjectMeta(ValueKind.BYTES, "", (), 4096, 1)
    count = 50000
    for i in range(count):
        key = b"\x01" + i.to_bytes(16, "little") + b"\x00" * 16
        index.put(key, region=i % 100, offset=i * 2 * UNIT, length=2 * UNIT, meta=meta)
    assert index.memory_bytes() / count <= 100
