"""The prefix key cache answers exactly what keying from scratch answers (router/kv/
key_cache.py), whatever prompts came before, evictions included, and stays in its
memory bound."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.kv.key_cache import PrefixKeyCache
from router.kv.keys import block_keys

# Prompts drawn from a few shared stems, so they share prefixes as a real trace does.
_stems = st.lists(st.integers(0, 3), min_size=0, max_size=90)
_prompts = st.lists(st.tuples(st.integers(0, 2), _stems), min_size=1, max_size=12)


@given(prompts=_prompts, block_size=st.sampled_from([1, 2, 4]),
       max_bytes=st.sampled_from([0, 300, 2_000, 1_000_000]))
def test_the_cache_answers_what_keying_from_scratch_answers(prompts, block_size, max_bytes):
    cache = PrefixKeyCache(max_bytes=max_bytes, chunk_blocks=2)
    stems = [[7] * 40, [7] * 20 + [8] * 20, [9] * 5]
    for stem, tail in prompts:
        ids = stems[stem] + tail
        assert cache.keys(ids, block_size) == block_keys(ids, block_size)
        assert cache.size_bytes <= max(max_bytes, 0) or len(cache) == 0


def test_a_shared_prefix_is_keyed_once():
    cache = PrefixKeyCache(chunk_blocks=4)
    system = list(range(1000, 1000 + 16 * 64))  # 64 blocks: 16 chunks
    first = cache.keys(system + [1, 2, 3] * 40, 16)
    assert cache.hits == 0
    second = cache.keys(system + [4, 5, 6] * 40, 16)
    assert cache.hits == 16  # the system prompt's chunks, reused
    assert first[:64] == second[:64] and first[64:] != second[64:]
    assert second == block_keys(system + [4, 5, 6] * 40, 16)


def test_block_sizes_do_not_share_chunks():
    cache = PrefixKeyCache(chunk_blocks=2)
    ids = list(range(64))
    assert cache.keys(ids, 4) == block_keys(ids, 4)
    assert cache.keys(ids, 8) == block_keys(ids, 8)
    assert cache.keys(ids, 4) == block_keys(ids, 4)


def test_threads_keying_at_once_get_exact_keys():
    cache = PrefixKeyCache(max_bytes=20_000, chunk_blocks=2)
    prompts = [[i % 5] * 64 + list(range(i, i + 40)) for i in range(40)]
    wrong: list[int] = []

    def work(offset: int) -> None:
        for k in range(200):
            ids = prompts[(k + offset) % len(prompts)]
            if cache.keys(ids, 4) != block_keys(ids, 4):
                wrong.append(k)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        PrefixKeyCache(chunk_blocks=0)
    with pytest.raises(ValueError):
        PrefixKeyCache().keys([1, 2, 3], 0)
