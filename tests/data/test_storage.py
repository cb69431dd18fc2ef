"""Shards on S3-compatible storage: a real moto server on loopback, spoken to over HTTP by s3fs."""

import urllib.request

import numpy as np
import pytest
import torch

from kiln.data.cache import LRUPolicy, StaticPolicy
from kiln.data.loader import Loader, TokenWindows
from kiln.data.shards import ShardSet, ShardWriter, write_meta
from kiln.data.storage import ShardCache, ShardStore
from kiln.errors import DataError

moto_server = pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

BUCKET = "kiln-test"


def start_server():
    """A moto S3 server bound to 127.0.0.1 on a free port, and s3fs options to reach it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    opts = {"endpoint_url": f"http://127.0.0.1:{server._server.server_port}", "key": "testing",
            "secret": "testing", "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1,
                                                   "read_timeout": 2}}
    return server, opts


@pytest.fixture(scope="module")
def s3_server():
    server, opts = start_server()
    yield opts
    server.stop()


def bucket_fs(opts):
    import s3fs

    # moto keeps its buckets per process: start every test from an empty store
    urllib.request.urlopen(urllib.request.Request(f"{opts['endpoint_url']}/moto-api/reset", method="POST"))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    fs.mkdir(BUCKET)
    return fs


@pytest.fixture()
def s3(s3_server):
    return None, bucket_fs(s3_server), s3_server


def write_shards(path, n_docs=12, shard_tokens=300):
    w = ShardWriter(path, "train", vocab_size=1000, eos_id=999, shard_tokens=shard_tokens)
    rng = np.random.default_rng(0)
    for _ in range(n_docs):
        w.add(rng.integers(0, 999, 99))
    w.finish()
    write_meta(path, [w])
    return path


def upload(fs, local, prefix="shards"):
    for f in sorted(local.iterdir()):
        fs.put_file(str(f), f"{BUCKET}/{prefix}/{f.name}")
    return f"s3://{BUCKET}/{prefix}"


def store(url, opts, cache_dir, **kw):
    kw.setdefault("retries", 1)
    kw.setdefault("backoff_s", 0.01)
    return ShardStore(url, cache_dir=cache_dir, storage_options=opts, **kw)


def planned(url, opts, cache_dir, granularity="auto", **kw):
    """A remote ShardSet whose store has picked its granularity (TokenWindows plans it)."""
    shards = ShardSet(url, "train", store(url, opts, cache_dir, granularity=granularity, **kw))
    TokenWindows(shards, seq_len=16)
    assert shards.store.mode == ("shard" if granularity == "auto" else granularity)  # auto: the 50 GiB default holds it
    return shards


def batches(shards, n, **kw):
    loader = Loader(TokenWindows(shards, seq_len=16), 4, seed=5, **kw)
    try:
        return [loader.next()[0] for _ in range(n)]
    finally:
        loader.close()


@pytest.mark.parametrize("granularity", ["shard", "window"])
def test_s3_and_local_give_identical_batches_with_a_small_cache(s3, tmp_path, granularity):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local")
    url = upload(fs, local)
    shard_bytes = max(f.stat().st_size for f in local.glob("*.tokens.npy"))
    st = store(url, opts, tmp_path / "cache", cache_bytes=3 * shard_bytes, granularity=granularity)
    remote = ShardSet(url, "train", st)
    assert len(remote.tokens) >= 4  # the dataset is larger than the cache
    want = batches(ShardSet(local, "train"), 40)  # > 1 epoch
    got = batches(remote, 40, lookahead=2)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    if granularity == "shard":
        cache = remote.store.cache
        assert cache.evictions > 0 and cache.used_bytes <= cache.max_bytes
        assert len(list((tmp_path / "cache").glob("*.cached"))) == len(cache.policy.sizes) + len(cache.scratch)
    else:  # windows, not files: no token file was downloaded whole
        assert st.mode == "window" and not list((tmp_path / "cache").glob("*.cached"))
        assert st.windows.hits > 0 and len(st.windows.where) <= st.windows.slots  # 2+ epochs: resident ones hit
        assert st.windows.max_bytes + st.cache.max_bytes <= 3 * shard_bytes


def test_auto_granularity_caches_windows_only_when_the_cache_is_smaller_than_the_split(s3, tmp_path):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local")
    url = upload(fs, local)
    data = sum(f.stat().st_size for f in local.glob("train-*.npy"))
    for cache_bytes, mode in ((2 * data, "shard"), (data // 2, "window")):
        shards = ShardSet(url, "train", store(url, opts, tmp_path / f"c{mode}", cache_bytes=cache_bytes))
        TokenWindows(shards, seq_len=16)
        assert shards.store.mode == mode
        if mode == "window":  # cache_policy "auto": CoorDL's static set for windows, LRU for whole files
            assert type(shards.store.windows.policy) is StaticPolicy
            assert type(shards.store.cache.policy) is LRUPolicy


def test_window_cache_hit_rates_per_epoch(s3, tmp_path):
    """Half the windows fit: static (CoorDL) hits exactly its resident windows from epoch 1 on,
    at least 1.5x what LRU gets over 3 epochs (the loader's real sampler and S3 reads)."""
    _, fs, opts = s3
    url = upload(fs, write_shards(tmp_path / "local"))
    rates = {}
    for name in ("lru", "static"):
        st = store(url, opts, tmp_path / name, cache_bytes=2400, granularity="window", cache_policy=name)
        windows = TokenWindows(ShardSet(url, "train", st), seq_len=16)
        assert len(windows) == 72 and 0 < st.windows.slots < 72  # 4 shards x 18 windows; batch 4 divides it
        loader = Loader(windows, 4, seed=5, lookahead=3)
        try:
            for _ in range(3 * 18):
                loader.next()
            rates[name] = {e: r for e, r in loader.cache_hit_rates().items() if e < 3}  # not the thread's lead
        finally:
            loader.close()
            st.close()
        if name == "static":
            assert rates[name] == {0: 0.0, 1: st.windows.slots / 72, 2: st.windows.slots / 72}
    assert sum(rates["static"].values()) >= 1.5 * sum(rates["lru"].values()), rates


def test_parallel_range_download_reassembles_the_file(s3, tmp_path):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local", n_docs=30, shard_tokens=10_000)
    url = upload(fs, local)
    st = store(url, opts, tmp_path / "cache", range_bytes=1000)
    name = "train-00000.tokens.npy"
    assert (local / name).stat().st_size > 3000  # several ranges
    assert st.local_path(name).read_bytes() == (local / name).read_bytes()


def test_prefetch_fills_the_cache_before_the_read(s3, tmp_path):
    _, fs, opts = s3
    url = upload(fs, write_shards(tmp_path / "local"))
    st = store(url, opts, tmp_path / "cache")
    names = ["train-00001.tokens.npy", "train-00002.tokens.npy"]
    st.prefetch(names)
    st._pool.shutdown(wait=True)  # wait for the downloads
    misses = st.cache.misses
    for name in names:
        assert st.cache.lookup(f"{url}/{name}") is not None
    assert st.cache.misses == misses


GRANULARITIES = ["auto", "window"]  # auto = whole shards here (the default cache holds them)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_missing_shard_names_the_file(s3, tmp_path, granularity):
    _, fs, opts = s3
    url = upload(fs, write_shards(tmp_path / "local"))
    fs.rm(f"{BUCKET}/shards/train-00001.tokens.npy")
    shards = planned(url, opts, tmp_path / "cache", granularity)
    with pytest.raises(DataError, match=r"train-00001\.tokens\.npy.*after 2 attempts"):
        shards.tokens[1][0:4]


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_truncated_and_corrupted_shards_are_refused(s3, tmp_path, granularity):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local")
    url = upload(fs, local)
    data = (local / "train-00000.tokens.npy").read_bytes()
    fs.pipe_file(f"{BUCKET}/shards/train-00000.tokens.npy", data[:len(data) - 20])
    fs.pipe_file(f"{BUCKET}/shards/train-00001.docs.npy", b"\x93NUMPY garbage")
    shards = planned(url, opts, tmp_path / "cache", granularity)
    with pytest.raises(DataError, match=r"train-00000\.tokens\.npy: cannot read shard"):
        shards.tokens[0][0:4]
    with pytest.raises(DataError, match=r"train-00001\.docs\.npy: cannot read shard"):
        shards.docs[1][0:2]


def test_window_reads_refuse_a_replaced_shard_and_name_short_ranges(s3, tmp_path, monkeypatch):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local")
    url = upload(fs, local)
    other = np.zeros(ShardSet(local, "train").tokens[2].shape[0], dtype=np.uint32)  # meta says uint16
    with fs.open(f"{BUCKET}/shards/train-00002.tokens.npy", "wb") as f:
        np.save(f, other)
    shards = planned(url, opts, tmp_path / "cache", "window", retries=0)
    with pytest.raises(DataError, match=r"train-00002\.tokens\.npy: has \d+ entries of uint32, meta.json says"):
        shards.tokens[2][0:4]
    st = shards.store
    shards.tokens[0][0:4]  # header read and checked
    # s3fs caches filesystem instances: patch through monkeypatch so later tests get the real one
    monkeypatch.setattr(st.fs, "cat_ranges", lambda paths, *a, **k: [b"short"] * len(paths), raising=False)
    monkeypatch.setattr(st.fs, "cat_file", lambda *a, **k: b"short", raising=False)
    with pytest.raises(DataError, match=r"train-00000\.tokens\.npy: cannot read bytes \d+-\d+.*after 1 attempts"):
        shards.tokens[0][16:33]


def test_local_truncated_shard_is_refused(tmp_path):
    local = write_shards(tmp_path / "local")
    f = local / "train-00000.tokens.npy"
    f.write_bytes(f.read_bytes()[:-20])
    with pytest.raises(DataError, match=r"train-00000\.tokens\.npy"):
        ShardSet(local, "train")


def test_hostile_meta_cannot_name_files_outside_the_directory(s3, tmp_path):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local")
    meta = (local / "meta.json").read_text().replace('"train-00000.tokens.npy"', '"../secret.npy"')
    (local / "meta.json").write_text(meta)
    with pytest.raises(DataError, match="plain names"):
        ShardSet(local, "train")
    url = upload(fs, local)
    with pytest.raises(DataError, match="plain names"):
        ShardSet(url, "train", store(url, opts, tmp_path / "cache"))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_endpoint_gone_mid_epoch_is_an_error_naming_the_shard(tmp_path, granularity):
    server, opts = start_server()  # its own server, since the test stops it
    try:
        fs = bucket_fs(opts)
        url = upload(fs, write_shards(tmp_path / "local"))
        shards = planned(url, opts, tmp_path / "cache", granularity)
        shards.tokens[0][0:4]  # read while the server is up
    finally:
        server.stop()
    with pytest.raises(DataError, match=r"train-00002\.tokens\.npy"):
        shards.tokens[2][0:4]
    assert np.asarray(shards.tokens[0][0:4]).shape == (4,)  # what is cached still reads


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_transient_failures_are_retried(s3, tmp_path, granularity, monkeypatch):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local")
    url = upload(fs, local)
    shards = planned(url, opts, tmp_path / "cache", granularity, retries=3)
    st = shards.store
    real, fails = st.fs.cat_file, [2]

    def flaky(*a, **k):
        if fails[0]:
            fails[0] -= 1
            raise ConnectionError("injected")
        return real(*a, **k)

    monkeypatch.setattr(st.fs, "cat_file", flaky, raising=False)  # s3fs caches instances: undo after the test
    monkeypatch.setattr(st.fs, "cat_ranges", lambda paths, *a, **k: [ConnectionError("injected")] * len(paths),
                        raising=False)  # window mode: the batched request fails, each range is retried
    want = ShardSet(local, "train").tokens[0][16:33]
    assert np.array_equal(shards.tokens[0][16:33], want) and fails[0] == 0


def test_cache_bound_and_restart(tmp_path):
    cache = ShardCache(tmp_path, max_bytes=250)
    for i in range(4):
        cache.path(f"u{i}").write_bytes(b"x" * 100)
        cache.admit(f"u{i}", 100)
    assert cache.used_bytes == 200 and cache.evictions == 2
    assert cache.lookup("u0") is None and cache.lookup("u3") is not None
    assert ShardCache(tmp_path, max_bytes=250).used_bytes == 200  # a restarted run reuses the cache


def test_training_reads_shards_from_s3(s3, tmp_path, text_file, monkeypatch):
    """`data.source = "s3://..."`: train from the loopback server, through a small shard cache."""
    import json

    from conftest import tiny_overrides
    from kiln.config import load_config
    from kiln.data.raw_to_shards import prepare_shards
    from kiln.train.trainer import train

    _, fs, opts = s3
    cfg = load_config(None, tiny_overrides(text_file, **{"train.steps": 3, "train.eval_every": 3,
                                                          "checkpoint.every": 0}))
    cfg.data.shards_dir = str(tmp_path / "local")
    prepare_shards(cfg.data, tmp_path)
    url = upload(fs, tmp_path / "local")
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    cfg.data.source, cfg.data.cache_dir, cfg.data.fetch_retries = url, str(tmp_path / "cache"), 1
    train(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [1, 2, 3]
    cache_rows = [r for r in rows if r.get("kind") == "cache"]  # the per-epoch hit rate, logged
    assert cache_rows and 0.0 <= cache_rows[-1]["epoch0_hit_rate"] <= 1.0
    assert list((tmp_path / "cache").glob("*.cached"))


def test_nearby_windows_of_a_shard_share_one_range_request(s3, tmp_path, monkeypatch):
    _, fs, opts = s3
    local = write_shards(tmp_path / "local")
    url = upload(fs, local)
    want = TokenWindows(ShardSet(local, "train"), seq_len=16)
    requests = {}
    for gap in (0, 1 << 20):
        shards = planned(url, opts, tmp_path / f"cache{gap}", "window", merge_gap=gap)
        windows = TokenWindows(shards, seq_len=16)
        real = shards.store.fs.cat_ranges
        sent = []
        monkeypatch.setattr(shards.store.fs, "cat_ranges",
                            lambda paths, *a, **k: (sent.extend(paths), real(paths, *a, **k))[1], raising=False)
        idx = np.array([0, 2, 4, 6, 9])  # windows of shard 0, not adjacent
        assert np.array_equal(windows.gather(idx), want.gather(idx))
        requests[gap] = len(sent)
        monkeypatch.undo()
    assert requests == {0: 5, 1 << 20: 1}
