# SPDX-License-Identifier: Apache-2.0
"""EngineDesc / MemoryDesc: pack/unpack round trips and hostile input."""
import pickle

import numpy as np
import pytest

import ferry
from conftest import make_engine


@pytest.fixture(scope="module")
def engine():
    e = make_engine("desc-engine", node_id="node-a")
    e.create_backend("tcp")
    yield e
    e.close()


def test_engine_desc_round_trip(engine):
    d = engine.get_engine_desc()
    assert d.key == "desc-engine" and d.node_id == "node-a" and d.port > 0 and d.pid > 0
    assert d.host == "127.0.0.1"
    assert "tcp" in d.backends and isinstance(d.backends["tcp"], bytes)
    packed = d.pack()
    assert isinstance(packed, bytes)
    back = ferry.EngineDesc.unpack(packed)
    assert back == d and not (back != d)
    assert ferry.EngineDesc.unpack(bytearray(packed)) == d
    assert ferry.EngineDesc.unpack(memoryview(packed)) == d
    assert pickle.loads(pickle.dumps(d)) == d
    assert '"desc-engine"' in d.to_json()
    assert "desc-engine" in repr(d)


def test_memory_desc_round_trip(engine):
    buf = np.zeros(1 << 16, dtype=np.uint8)
    m = engine.register_buffer(buf)
    try:
        assert m.engine_key == "desc-engine" and m.size == buf.nbytes
        assert m.addr == buf.ctypes.data
        assert m.location == ferry.MemoryLocationType.CPU
        assert "tcp" in m.backends
        back = ferry.MemoryDesc.unpack(m.pack())
        assert back == m
        assert back.id == m.id and back.size == m.size and back.device_id == m.device
        assert pickle.loads(pickle.dumps(m)) == m
        other = engine.register_buffer(bytearray(16))
        assert other != m
        engine.deregister_memory(other)
    finally:
        engine.deregister_memory(m)


def test_descriptors_are_read_only(engine):
    d = engine.get_engine_desc()
    with pytest.raises(AttributeError):
        d.key = "x"


@pytest.mark.parametrize("cls", [ferry.EngineDesc, ferry.MemoryDesc])
def test_malformed_blobs_raise_value_error(engine, cls):
    good = (engine.get_engine_desc() if cls is ferry.EngineDesc
            else engine.register_buffer(bytearray(64))).pack()
    for bad in [b"", b"\x00", b"garbage" * 10, good[: len(good) // 2], good[:-1]]:
        with pytest.raises(ValueError) as ei:
            cls.unpack(bad)
        assert ei.value.code == ferry.StatusCode.ERR_INVALID_ARGS
    # The other kind of descriptor is not this one.
    other = (engine.register_buffer(bytearray(64)) if cls is ferry.EngineDesc
             else engine.get_engine_desc()).pack()
    with pytest.raises(ValueError):
        cls.unpack(other)
    with pytest.raises(TypeError):
        cls.unpack("a string")


def test_register_remote_engine_takes_packed_bytes():
    a, b = make_engine("rb-a"), make_engine("rb-b")
    try:
        a.register_remote_engine(b.get_engine_desc().pack())
        with pytest.raises(ValueError):
            a.register_remote_engine(b"\x01\x02")
        with pytest.raises(ValueError):
            a.register_remote_engine(a.get_engine_desc())  # itself
        a.deregister_remote_engine(b.get_engine_desc())
    finally:
        a.close()
        b.close()
