# SPDX-License-Identifier: Apache-2.0
"""One transfer over many regions and prepared lists, against a target in its
own process: items as tuples or numpy arrays, index arrays read in place, the
message once after all the data."""
import numpy as np
import pytest

import ferry
from conftest import pattern
from test_notifications import peer, received  # noqa: F401  (the fixture)
from test_process import sha

BLOCK = 16 << 10


@pytest.fixture(scope="module")
def regions(peer):  # noqa: F811
    arrs = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(3)]
    mems = [peer.eng.register_buffer(a) for a in arrs]
    yield arrs, mems
    for m in mems:
        peer.eng.deregister_memory(m)


def test_items_over_three_local_regions(peer, regions):  # noqa: F811
    arrs, mems = regions
    for i, a in enumerate(arrs):
        a[:] = pattern(a.size, 70 + i)
    # block b of local region b % 3 -> remote block b
    items = [(b % 3, (b // 3) * BLOCK, 0, b * BLOCK, BLOCK) for b in range(48)]
    st = peer.eng.transfer("write", mems, [peer.mem], items, 5, notify=False, message=b"48 blocks")
    assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
    assert received(peer) == [("initiator", b"48 blocks")]
    want = np.concatenate([arrs[b % 3][(b // 3) * BLOCK:(b // 3 + 1) * BLOCK] for b in range(48)])
    assert peer.ask(f"sha 0 {48 * BLOCK}") == "SHA " + sha(want)
    # The same as an int64 array; READ back into region 2.
    back = np.array([(2, b * BLOCK, 0, b * BLOCK, BLOCK) for b in range(48)], dtype=np.int64)
    arrs[2][:] = 0
    st = peer.eng.transfer("READ", mems, [peer.mem], back, 6, notify=False)
    assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
    assert np.array_equal(arrs[2][: 48 * BLOCK], want)
    with pytest.raises(ValueError):
        peer.eng.transfer("copy", mems, [peer.mem], items, 7)
    bad = peer.eng.transfer("write", mems, [peer.mem], [(9, 0, 0, 0, 8)], 7)
    assert bad.Code() == ferry.StatusCode.ERR_INVALID_ARGS, bad.Message()


def test_prepared_lists_by_numpy_index_arrays(peer, regions):  # noqa: F811
    arrs, mems = regions
    for i, a in enumerate(arrs):
        a[:] = pattern(a.size, 80 + i)
    per = arrs[0].size // BLOCK
    entries = np.array([(r, b * BLOCK, BLOCK) for r in range(3) for b in range(per)], dtype=np.int64)
    lp = peer.eng.prepare_list(mems, entries)
    rp = peer.eng.prepare_list([peer.mem], [(0, b * BLOCK, BLOCK) for b in range(per * 4)])
    assert len(lp) == 3 * per and lp.local and not rp.local and rp.engine_key == "target"
    rng = np.random.default_rng(3)
    li = rng.permutation(len(lp))[:100].astype(np.int64)
    ri = rng.permutation(len(rp))[:100].astype(np.int64)
    st = peer.eng.transfer_prepared("write", lp, li, rp, ri, 8, notify=False, message="kv")
    assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
    assert received(peer) == [("initiator", b"kv")]
    for k in (0, 57, 99):
        r, off, n = entries[li[k]]
        assert peer.ask(f"sha {ri[k] * BLOCK} {BLOCK}") == "SHA " + sha(arrs[r][off:off + n])
    bad = peer.eng.transfer_prepared("write", lp, np.array([len(lp)], dtype=np.int64), rp,
                                     np.array([0], dtype=np.int64), 9)
    assert bad.Code() == ferry.StatusCode.ERR_INVALID_ARGS, bad.Message()
    with pytest.raises(ValueError):
        peer.eng.transfer_prepared("write", lp, [0, 1], rp, [0], 9)
    with pytest.raises(ferry.InvalidArgumentError):
        peer.eng.prepare_list(mems, [(0, (1 << 20) - 1, 2)])


def test_cancel_of_an_ended_transfer_is_a_no_op(peer, regions):  # noqa: F811
    arrs, mems = regions
    st = peer.eng.write(mems[0], 0, peer.mem, 0, 4096, 11, notify=False)
    assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
    assert st.Cancel() is False
    assert st.Code() == ferry.StatusCode.SUCCESS
    assert int(ferry.StatusCode.ERR_CANCELLED) == 19
