"""The verdict names the right bottleneck, with the right numbers and advice.

Synthetic op measurements, one scenario per bottleneck class: storage, disk,
CPU, link, GPU decode and compute (the model). Each starts from a balanced,
fast machine and slows exactly one op down.
"""

from __future__ import annotations

import dataclasses

import pytest

from fastload.diagnose.report import verdict_from_dict
from fastload.diagnose.verdict import Inputs, Verdict, make_verdict, payload_bytes

KB, MB, GB = 1e3, 1e6, 1e9


def fast(**changes: object) -> Inputs:
    """A machine where nothing is slow: every op well above 10,000 img/s."""
    base = Inputs(
        sample_bytes=110 * KB,
        sample_bytes_source="test",
        cpu_cores=16,
        gpu_present=True,
        storage_url="s3://bucket/train/",
        storage_bps=10 * GB,
        storage_connections=8,
        storage_one_conn_bps=2 * GB,
        storage_ttfb_s=0.001,
        cache_disk_bps=5 * GB,
        cache_index_lookups_s=200_000,
        cache_entries=1_000_000,
        cache_decode_bps_per_core=5 * GB,
        cpu_decode_per_core=2000,
        h2d_bps=25 * GB,
        h2d_pageable_bps=20 * GB,
        gpu_decode_img_s=50_000,
        dataset_bytes=140 * GB,
        cache_limit_bytes=500 * GB,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def settings_of(v: Verdict) -> dict[str, str]:
    return {a.setting: a.value for a in v.advice}


def why_of(v: Verdict, setting: str) -> str:
    return next(a.why for a in v.advice if a.setting == setting)


# -- storage ------------------------------------------------------------------------


def test_slow_storage_limits_epoch_one_and_the_cache_fixes_later_epochs():
    v = make_verdict(fast(storage_bps=12.5 * MB, storage_one_conn_bps=12 * MB, storage_connections=1))

    assert v.cold.bottleneck == "storage" and v.cold.limit == "storage"
    assert v.cold.samples_per_s == pytest.approx(12.5e6 / 110e3)
    assert "storage-bound: 12.5 MB/s from s3://bucket/train/ with 1 connection caps 110 KB samples at 114 img/s" in v.cold.sentence
    # The cache is on and holds the dataset, so epochs 2+ are not storage-bound.
    assert not v.streams_every_epoch and v.bottleneck != "storage"
    advice = settings_of(v)
    assert advice["pre-stage"] == "fastload cache s3://bucket/train/"
    assert "140 GB once, about 3.1 h" in why_of(v, "pre-stage")


def test_cache_off_makes_every_epoch_storage_bound_and_advice_turns_it_on():
    v = make_verdict(fast(storage_bps=12.5 * MB, cache=False))

    assert v.streams_every_epoch
    assert v.bottleneck == "storage" and v.warm.limit == "storage"
    assert v.headline.startswith("storage-bound:")
    assert settings_of(v)["cache"] == "on (the default)"
    # It quotes what epochs 2+ would reach with the cache on: CPU decode, 2000 x 16.
    assert "32,000 img/s" in why_of(v, "cache")
    assert "every epoch:" in "\n".join(v.lines())


def test_dataset_larger_than_the_cache_streams_every_epoch():
    v = make_verdict(fast(storage_bps=100 * MB, dataset_bytes=800 * GB, cache_limit_bytes=500 * GB))

    assert v.streams_every_epoch and v.bottleneck == "storage"
    assert settings_of(v)["FASTLOAD_CACHE_LIMIT / --cache-limit"] == ">= 880 GB"


def test_storage_that_needs_more_connections_than_the_loader_opens():
    v = make_verdict(fast(storage_bps=1 * GB, storage_one_conn_bps=20 * MB, storage_connections=64,
                          storage_ttfb_s=0.02, cache=False))

    assert v.bottleneck == "storage"
    advice = settings_of(v)
    assert advice["read_threads"] == "64"
    # 8 threads x 20 MB/s = 160 MB/s of 1 GB/s.
    assert "read_threads=8 reaches about 1,500 img/s of 9,100" in why_of(v, "read_threads")
    assert advice["data layout"].startswith("tar shards of 64 MB")
    assert "waits 20 ms" in why_of(v, "data layout")


def test_shaped_link_rates_give_different_verdicts():
    """100 Mbit storage limits epoch 1; at 1 Gbit the 2-core CPU decode does."""
    slow_cpu = dict(cpu_cores=2, cpu_decode_per_core=300, sample_bytes=96 * KB)
    at_100m = make_verdict(fast(storage_bps=12.1 * MB, **slow_cpu))
    at_1g = make_verdict(fast(storage_bps=118 * MB, **slow_cpu))

    assert at_100m.cold.bottleneck == "storage" and at_100m.cold.samples_per_s == pytest.approx(126, rel=0.01)
    assert at_1g.cold.bottleneck == "cpu" and at_1g.cold.samples_per_s == pytest.approx(600)
    assert at_100m.op("storage").samples_per_s * 9 < at_1g.op("storage").samples_per_s


# -- index --------------------------------------------------------------------------


def test_a_slow_cache_index_is_named_not_the_disk():
    # A loader ran at 9,800 samples/s on index work while the disk allowed 41,000 (issue 31).
    v = make_verdict(fast(cache_index_lookups_s=9_800, cache_disk_bps=41_000 * 4096, sample_bytes=4096))

    assert v.bottleneck == "index" and v.warm.limit == "cache_index"
    assert v.warm.samples_per_s == pytest.approx(9_800)
    assert v.headline.startswith("index-bound") and "1,000,000 entries" in v.headline
    assert settings_of(v)["data layout"].startswith("tar shards")
    assert v.op("cache_disk").samples_per_s == pytest.approx(41_000)


def test_an_unmeasured_index_says_why():
    v = make_verdict(fast(cache_index_lookups_s=None, why_missing={"cache_index": "the cache is empty"}))

    assert v.bottleneck != "index" and "the cache is empty" in v.op("cache_index").detail


# -- disk ---------------------------------------------------------------------------


def test_slow_cache_disk_limits_warm_epochs():
    v = make_verdict(fast(cache_disk_bps=50 * MB))

    assert v.bottleneck == "disk" and v.warm.limit == "cache_disk"
    assert v.warm.samples_per_s == pytest.approx(50e6 / 110e3)
    assert settings_of(v)["FASTLOAD_CACHE_DIR"] == "a faster local disk (NVMe)"
    # The remote (10 GB/s) is faster than this disk: caching slows later epochs.
    assert settings_of(v)["cache"].startswith("off")


# -- CPU ----------------------------------------------------------------------------


def test_cpu_decode_limits_and_advice_moves_decode_to_the_gpu():
    v = make_verdict(fast(cpu_cores=16, cpu_decode_per_core=25, read_threads=4))

    assert v.bottleneck == "cpu" and v.warm.limit == "cpu_decode" and v.cold.limit == "cpu_decode"
    assert v.headline == "CPU-bound: JPEG decode at 25 img/s per core x 16 cores caps at 400 img/s"
    advice = settings_of(v)
    assert advice["pipeline placement"].startswith("decode on the GPU")
    assert "this GPU decodes 50,000 img/s" in why_of(v, "pipeline placement")
    assert advice["read_threads / num_workers"] == "16 or more"
    assert "read_threads=4 uses fewer" in why_of(v, "read_threads / num_workers")
    # With the default 8 threads on 2 cores, there is nothing to raise.
    assert "read_threads / num_workers" not in settings_of(make_verdict(fast(cpu_cores=2, cpu_decode_per_core=100)))


def test_cpu_bound_without_a_gpu_says_so():
    v = make_verdict(fast(cpu_cores=2, cpu_decode_per_core=150, gpu_present=False, h2d_bps=None,
                          gpu_decode_img_s=None, why_missing={"link": "no CUDA device"}))

    assert v.bottleneck == "cpu"
    assert "no usable GPU" in why_of(v, "pipeline placement")
    assert v.op("link").samples_per_s is None
    assert v.op("link").detail == "not measured: no CUDA device"
    assert any("not measured, so not considered: GPU link" in n for n in v.notes)


# -- link ---------------------------------------------------------------------------


def test_egpu_link_caps_fp32_and_advice_ships_uint8():
    v = make_verdict(fast(h2d_bps=2.6 * GB, h2d_pageable_bps=1.2 * GB, link_payload="fp32"))

    assert v.bottleneck == "link" and v.warm.limit == "link"
    assert v.headline == ("link-bound: 2.6 GB/s H2D caps fp32 224x224 at 4,300 img/s; ship uint8 and normalise "
                          "on GPU (pipeline dtype='uint8') for about 17,000")
    advice = settings_of(v)
    assert advice["link payload"] == "uint8"
    assert advice["device"].startswith("'cuda'")  # pageable 1.2 GB/s vs pinned 2.6
    assert advice["prefetch_to_device"] == "3"


def test_link_bound_on_uint8_suggests_jpeg_and_on_jpeg_a_faster_link():
    on_uint8 = make_verdict(fast(h2d_bps=1 * GB, link_payload="uint8"))
    assert on_uint8.bottleneck == "link"
    assert settings_of(on_uint8)["link payload"] == "jpeg"

    on_jpeg = make_verdict(fast(h2d_bps=0.5 * GB, decode_on="gpu"))
    assert on_jpeg.bottleneck == "link" and on_jpeg.op("link").label == "GPU link (JPEG)"
    assert on_jpeg.warm.samples_per_s == pytest.approx(0.5e9 / 110e3)
    assert settings_of(on_jpeg)["GPU link"].startswith("a faster link")
    # With decode on the GPU the CPU decode row is listed but not on the path.
    assert on_jpeg.op("cpu_decode").in_path is False


# -- GPU decode and the model ----------------------------------------------------------


def test_gpu_decode_limits_when_decoding_on_the_gpu():
    v = make_verdict(fast(decode_on="gpu", gpu_decode_img_s=900))

    assert v.bottleneck == "gpu" and v.warm.limit == "gpu_decode"
    assert settings_of(v)["decode split"].startswith("decode part of each batch")


def test_model_slower_than_every_data_op_is_compute_bound():
    v = make_verdict(fast(model_img_s=3000))

    assert v.bottleneck == "compute" and v.warm.limit == "model" and v.cold.limit == "model"
    # Slowest data op: CPU decode at 2,000 img/s x 16 cores (the link gives 41,521).
    assert "(CPU JPEG decode) delivers 32,000 (10.7x headroom)" in v.headline
    assert settings_of(v)["data pipeline"] == "no change needed"
    assert "prefetch_to_device" not in settings_of(v)


def test_model_with_little_headroom_gets_a_deeper_prefetch():
    v = make_verdict(fast(model_img_s=3000, cpu_cores=2, cpu_decode_per_core=1600))

    assert v.bottleneck == "compute"
    assert settings_of(v)["prefetch_to_device"] == "3"
    assert any("within 15%" in n for n in v.notes)


# -- mechanics ----------------------------------------------------------------------


def test_payload_bytes_per_representation():
    assert payload_bytes("fp32", 108e3, 224) == 602_112
    assert payload_bytes("fp16", 108e3, 224) == 301_056
    assert payload_bytes("uint8", 108e3, 224) == 150_528
    assert payload_bytes("jpeg", 108e3, 224) == 108e3
    with pytest.raises(ValueError, match="bf8"):
        payload_bytes("bf8", 1, 224)


@pytest.mark.parametrize("change", [{"sample_bytes": 0}, {"decode_on": "tpu"}, {"link_payload": "int4"}])
def test_invalid_inputs_are_rejected(change):
    with pytest.raises(ValueError):
        make_verdict(fast(**change))


def test_nothing_measured_still_gives_a_verdict():
    v = make_verdict(Inputs(sample_bytes=100e3))

    assert v.bottleneck is None and v.cold.limit is None
    assert v.headline == "no op on this path was measured"
    assert all(s.samples_per_s is None for s in v.ops)


def test_verdict_round_trips_through_its_dict_and_renders():
    v = make_verdict(fast(h2d_bps=2.6 * GB))
    again = verdict_from_dict(v.as_dict())

    assert again == v
    text = "\n".join(v.lines())
    assert text.splitlines()[0].split() == ["op", "max", "samples/s", "measured", "epochs"]
    assert "verdict: link-bound" in text and "change:" in text
    assert "- link payload: uint8." in text


def test_data_that_is_not_decoded_never_has_a_decode_bottleneck():
    # Arrays or tokens (decode_on="none"): a slow JPEG decode measured on sample photos once
    # gave "CPU-bound: JPEG decode ... decode on a GPU" for .bin / .npy data.
    slow_cpu = fast(cpu_decode_per_core=50, cpu_cores=2, decode_on="none")
    v = make_verdict(slow_cpu)
    assert v.bottleneck != "cpu" and "JPEG" not in v.headline
    assert not v.op("cpu_decode").in_path and not v.op("gpu_decode").in_path
    assert not any("JPEG" in a.value + a.why or a.setting == "pipeline placement" for a in v.advice)
    # What crosses the link is the sample as stored, not decoded pixels.
    link = make_verdict(dataclasses.replace(slow_cpu, h2d_bps=0.5 * GB)).op("link")
    assert link.label == "GPU link (samples as stored)"
    assert link.samples_per_s == pytest.approx(0.5 * GB / (110 * KB))
    assert make_verdict(dataclasses.replace(slow_cpu, decode_on="cpu")).bottleneck == "cpu"
