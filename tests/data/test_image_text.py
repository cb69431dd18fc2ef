"""Image-text tar shards: the generated sample, CPU-worker vs device preprocessing, order and resume,
bad input, and the image part of `kiln loader-bench`."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from kiln.cli import main
from kiln.data.image_sample import add_member, encode_picture, write_sample_shards
from kiln.data.image_ops import ImageSpec, decode, pad_captions, transform
from kiln.data.image_text import ImageTextLoader, TarIndex
from kiln.data.stall_image import step_time
from kiln.data.tokenizer import ByteTokenizer
from kiln.errors import DataError, KilnError
from kiln.report.run_page import build_report

SPEC = ImageSpec(size=16)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("image-text")
    write_sample_shards(d, n=24, shards=3, seed=1, min_side=18, max_side=40)
    return d


def loader(index, **kw):
    kw = {"batch_size": 4, "spec": SPEC, "caption_len": 24, "seed": 3, "log": lambda _m: None, **kw}
    return ImageTextLoader(index, ByteTokenizer(), **kw)


def test_sample_has_jpeg_and_png_pairs_of_varying_size(shards):
    names = sorted(p.name for p in shards.glob("*.tar"))
    assert names == ["sample-00000.tar", "sample-00001.tar", "sample-00002.tar"]
    index = TarIndex(shards)
    assert len(index) == 24 and not index.skipped
    assert {s.kind for s in index.samples} == {"jpeg", "png"}
    sizes = {tuple(decode(index.read(s.shard, s.image_range)).shape) for s in index.samples}
    assert len(sizes) > 5 and all(c == 3 and 18 <= h <= 40 and 18 <= w <= 40 for c, h, w in sizes)
    caption = index.read(0, index.samples[0].caption_range).decode()
    assert caption.startswith("a ") and ("square" in caption or "rectangle" in caption)


def test_transform_crops_and_normalizes_exact_pixels():
    # an image whose shorter side already is the resize target: no resampling, the crop is exact
    spec = ImageSpec(size=4, resize=6)
    img = torch.randint(0, 256, (3, 6, 9), dtype=torch.uint8)
    out = transform([img], spec, seed=0, epoch=0, indices=[0])[0]
    mean, std = torch.tensor(spec.mean).view(3, 1, 1), torch.tensor(spec.std).view(3, 1, 1)
    expected = (img[:, 1:5, 2:6].float() / 255 - mean) / std
    assert out.shape == expected.shape and (out - expected).abs().max() < 1e-6  # torch.testing costs 3 s to import
    # PNG is lossless: decode gives back the pixels that were encoded
    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    assert torch.equal(decode(encode_picture(pixels, "png")), torch.from_numpy(pixels).permute(2, 0, 1))
    gif = io.BytesIO()
    Image.fromarray(pixels).save(gif, format="GIF")
    with pytest.raises(ValueError, match="not a JPEG or PNG image"):  # whatever the decoder could read
        decode(gif.getvalue())


def test_cpu_workers_equal_device_path_on_cpu(shards):
    index = TarIndex(shards)
    for crop in ("center", "random"):
        spec = ImageSpec(size=16, crop=crop)
        cpu, dev = loader(index, spec=spec, mode="cpu", workers=2), loader(index, spec=spec, mode="device")
        for _ in range(3):
            a, b = cpu.next(), dev.next()
            assert a.indices == b.indices and a.images.shape == (4, 3, 16, 16)
            # same decoder and transform code on both paths, so equal up to float rounding
            assert (a.images - b.images).abs().max() <= 1e-5
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
        cpu.close()


def test_order_is_deterministic_each_epoch_complete_and_resume_exact(shards):
    index = TarIndex(shards)
    first = loader(index)
    seen = [first.next() for _ in range(6)]  # 24 samples / 4 = one epoch
    assert sorted(i for b in seen for i in b.indices) == list(range(24))
    assert [b.indices for b in seen] != [list(range(i, i + 4)) for i in range(0, 24, 4)]  # shuffled
    assert first.state_dict() == {"epoch": 0, "position": 24, "seed": 3}
    rest = [first.next() for _ in range(3)]
    assert rest[0].epoch == 1 and [b.indices for b in rest] != [b.indices for b in seen[:3]]

    again = loader(index, workers=1, spec=ImageSpec(size=16, crop="random"))
    again.load_state_dict({"epoch": 0, "position": 24, "seed": 3})
    resumed = [again.next() for _ in range(3)]
    assert [b.indices for b in resumed] == [b.indices for b in rest]
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(rest, resumed))
    again.close()
    other = loader(index, seed=4)
    assert [other.next().indices for _ in range(2)] != [b.indices for b in seen[:2]]


def test_captions_go_through_a_trained_bpe_tokenizer_in_workers(shards):
    from kiln.data.tokenizer import train_bpe

    index = TarIndex(shards)
    captions = [index.read(s.shard, s.caption_range).decode() for s in index.samples]
    bpe = train_bpe(iter(captions), vocab_size=300)
    batch = ImageTextLoader(index, bpe, batch_size=4, spec=SPEC, caption_len=6, workers=1, log=print).next()
    for row, i in enumerate(batch.indices):
        ids = bpe.encode(captions[i])[:6]
        assert batch.tokens[row, :len(ids)].tolist() == ids and batch.lengths[row] == len(ids)
        assert (batch.tokens[row, len(ids):] == bpe.eos_id).all()


def test_shards_from_an_fsspec_url_read_like_local_ones(shards, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for p in shards.glob("*.tar"):
        fs.pipe(f"/imgtest/{p.name}", p.read_bytes())
    try:
        from kiln.data.storage import ShardStore

        url = "memory://imgtest"
        remote = TarIndex(url, store=ShardStore(url, cache_dir=tmp_path / "cache"))
        a, b = loader(remote).next(), loader(TarIndex(shards)).next()
        assert a.indices == b.indices and torch.equal(a.images, b.images)
        assert "memory://imgtest/sample-" in remote.where(0)
    finally:
        fs.rm("/imgtest", recursive=True)


def write_tar(path, members):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            add_member(tar, name, data)
    return path


def good_pair(key, side=20):
    pixels = np.full((side, side, 3), 120, dtype=np.uint8)
    return [(f"{key}.png", encode_picture(pixels, "png")), (f"{key}.txt", b"a grey square")]


def test_undecodable_image_is_retried_then_named_or_skipped_and_counted(tmp_path):
    write_tar(tmp_path / "a.tar", good_pair("k0") + [("k1.jpg", b"\xff\xd8 not a jpeg"), ("k1.txt", b"broken")]
              + good_pair("k2") + good_pair("k3"))
    for mode in ("cpu", "device"):
        bad = loader(TarIndex(tmp_path), mode=mode, retries=2, backoff_s=0.001)
        with pytest.raises(DataError) as e:
            for _ in range(2):
                bad.next()
        msg = str(e.value)
        with tarfile.open(tmp_path / "a.tar") as tar:
            offset = tar.getmember("k1.jpg").offset
        assert "\n" not in msg and f"{tmp_path / 'a.tar'}: sample 'k1' at offset {offset}: " in msg
        assert "after 3 attempts" in msg and "0x" not in msg
        logged = []
        ok = loader(TarIndex(tmp_path, skip_bad=True), mode=mode, backoff_s=0.001, log=logged.append)
        batch = ok.next()
        assert sorted(batch.indices) == [0, 2, 3] and batch.images.shape[0] == 3 and batch.tokens.shape[0] == 3
        assert ok.skipped == 1 and len(logged) == 1 and "'k1'" in logged[0] and len(batch.skipped) == 1


def test_missing_caption_and_truncated_tar_are_named_or_skipped(tmp_path):
    write_tar(tmp_path / "a.tar", good_pair("k0") + [("k1.jpg", encode_picture(np.zeros((9, 9, 3), np.uint8), "jpg"))]
              + good_pair("k2"))
    with pytest.raises(DataError, match=r"a\.tar: sample 'k1' at offset \d+ has no caption"):
        TarIndex(tmp_path)
    logged = []
    index = TarIndex(tmp_path, skip_bad=True, log=logged.append)
    assert len(index) == 2 and len(index.skipped) == 1 and "no caption" in logged[0]

    full = write_tar(tmp_path / "b.tar", good_pair("m0") + good_pair("m1", side=40))
    with tarfile.open(full) as tar:
        cut = tar.getmember("m1.png").offset_data + 100  # the download stopped inside m1's image
    full.write_bytes(full.read_bytes()[:cut])
    with pytest.raises(DataError, match=r"b\.tar: truncated or corrupt tar after offset \d+ \(member 'm1.png'"):
        TarIndex(tmp_path, ["b.tar"])
    index = TarIndex(tmp_path, ["b.tar"], skip_bad=True, log=lambda _m: None)
    assert [s.key for s in index.samples] == ["m0"] and len(index.skipped) == 1
    counted = loader(index, batch_size=1)
    assert counted.skipped == 1 and counted.next().indices == [0]


def test_bad_settings_are_one_line_errors(shards):
    index = TarIndex(shards)
    if not torch.cuda.is_available():
        with pytest.raises(KilnError, match="device 'cuda' asked, but torch sees no CUDA device"):
            loader(index, mode="device", device="cuda")
    with pytest.raises(KilnError, match="preprocessing mode 'gpu'"):
        loader(index, mode="gpu")
    with pytest.raises(DataError, match="global batch of 32 samples"):
        loader(index, batch_size=32)
    with pytest.raises(KilnError, match="workers=-1"):
        loader(index, workers=-1)
    with pytest.raises(KilnError, match="resize=8"):
        ImageSpec(size=16, resize=8)
    with pytest.raises(DataError, match="nowhere: not a directory of .tar shards"):
        TarIndex(shards / "nowhere")
    (shards.parent / "empty").mkdir(exist_ok=True)
    with pytest.raises(DataError, match="empty: no .tar shards"):
        TarIndex(shards.parent / "empty")


def test_captions_are_padded_and_truncated():
    tokens, lengths = pad_captions([np.arange(1, 4), np.arange(1, 9)], 5, pad_id=0)
    assert tokens.tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]] and lengths.tolist() == [3, 5]


def test_step_model_overlaps_workers_but_not_the_main_process():
    assert step_time(0.010, 0.030, 0.030, workers=0) == pytest.approx(0.040)  # nothing overlaps
    assert step_time(0.010, 0.005, 0.002, workers=2) == pytest.approx(0.012)  # device decode adds to the step
    assert step_time(0.010, 0.030, 0.000, workers=2) == pytest.approx(0.030)  # workers too slow: they set the pace


def test_loader_bench_image_text_compares_paths(shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(["loader-bench", "--image-text", str(shards), "--step-ms", "1000", "--image-size", "16", "--workers", "0,1",
          "--steps", "2", "--run-dir", str(run_dir), "--set", "data.tokenizer=byte", "--set", "train.batch_size=4"])
    report = json.loads((run_dir / "reports" / "loader-bench-image.json").read_text())
    assert [(r["mode"], r["workers"]) for r in report["configs"]] == [("cpu", 0), ("cpu", 1), ("device", 0),
                                                                      ("device", 1)]
    assert all(r["cold_batch_s"] > 0 and 0 <= r["stall_fraction"] < 1 for r in report["configs"])
    assert report["samples"] == 24 and report["recommended"]["mode"] in ("cpu", "device")
    assert (run_dir / "reports" / "loader-bench-image.svg").read_text().startswith("<svg")
    assert "recommended:" in capsys.readouterr().out
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 3.0, "lr": 0.001}\n')
    html, _, warnings = build_report(run_dir)  # the run page charts it from the JSON
    assert 'id="chart-loader-bench-image"' in html and "device, 1 worker(s)" in html and not warnings
    hostile = dict(report, configs=[dict(report["configs"][0], step_s="<script>")])
    (run_dir / "reports" / "loader-bench-image.json").write_text(json.dumps(hostile))
    html, _, warnings = build_report(run_dir)
    assert "chart-loader-bench-image" not in html and "<script>" not in html
    assert any("not a loader-bench image report" in w for w in warnings)
    assert main(["loader-bench", "--image-text", str(shards), "--run-dir", str(run_dir)]) == 2
    assert "needs --step-ms" in capsys.readouterr().err
    if not torch.cuda.is_available():  # refused before anything is measured
        assert main(["loader-bench", "--image-text", str(shards), "--step-ms", "10", "--device", "cuda",
                     "--run-dir", str(run_dir)]) == 2
        captured = capsys.readouterr()
        assert "torch sees no CUDA device" in captured.err and "worker(s)" not in captured.out


def test_remote_read_whose_download_finishes_at_once_does_not_deadlock(shards, tmp_path):
    """ShardStore registers its bookkeeping callback on the download future while holding its lock;
    a download already finished runs that callback at once, in the same thread (a hang seen here
    under load before the lock was made reentrant)."""
    import threading

    import fsspec

    from kiln.data.storage import ShardStore

    fsspec.filesystem("memory").pipe("/imgfast/sample-00000.tar", (shards / "sample-00000.tar").read_bytes())
    store = ShardStore("memory://imgfast", cache_dir=tmp_path / "cache")
    submit = store._pool.submit

    def finished_submit(*a, **k):  # the pool thread wins the race every time
        fut = submit(*a, **k)
        fut.result()
        return fut

    store._pool.submit = finished_submit
    result = []
    reader = threading.Thread(target=lambda: result.append(store.local_path("sample-00000.tar")), daemon=True)
    reader.start()
    reader.join(timeout=20)
    fsspec.filesystem("memory").rm("/imgfast", recursive=True)
    assert not reader.is_alive() and result and result[0].is_file()
