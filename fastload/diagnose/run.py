"""``fastload diagnose``: run every probe, then the verdict; one JSON-ready dict.

Order matters in two places. The link is measured before NVML is read, so a GPU
that parks its PCIe link at Gen1 when idle reports the generation it trains at.
And compute probes run on the dataset's own JPEGs when the storage probe found
some, else on built-in samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastload.config import Settings, default_read_threads
from fastload.diagnose import compute, disk, env, gpu, link, storage
from fastload.diagnose._util import guarded, skipped
from fastload.diagnose.verdict import Inputs, make_verdict

__all__ = ["DEFAULT_SAMPLE_BYTES", "MODES", "Budget", "Options", "run_diagnose"]

#: The ImageNet-1k training set averages about 108 KB per JPEG: about 138 GB for 1,281,167
#: images (PaddlePaddle/models issue 1633, facebookresearch/dino issue 48).
DEFAULT_SAMPLE_BYTES = 108_000


@dataclass(frozen=True)
class Budget:
    """Time and bytes each probe may spend."""

    storage: storage.StorageBudget
    disk_bytes: int
    disk_s: float
    decode_s: float
    images: int
    lz4_s: float
    link_bytes: int
    link_repeats: int
    gpu_decode_s: float


MODES = {
    "quick": Budget(storage.StorageBudget(level_s=0.5, max_level_bytes=128 * 10**6, ttfb_requests=5, objects=16,
                                          head_requests=8, max_connections=32),
                    disk_bytes=32 * 1024**2, disk_s=0.5, decode_s=0.3, images=4, lz4_s=0.15,
                    link_bytes=32 * 1024**2, link_repeats=3, gpu_decode_s=0.5),
    "default": Budget(storage.StorageBudget(),
                      disk_bytes=128 * 1024**2, disk_s=1.0, decode_s=0.7, images=8, lz4_s=0.3,
                      link_bytes=64 * 1024**2, link_repeats=5, gpu_decode_s=1.0),
    "thorough": Budget(storage.StorageBudget(level_s=3.0, max_level_bytes=2 * 10**9, ttfb_requests=30, objects=128,
                                             head_requests=64, chunk_bytes=4 * 1024**2, max_connections=128,
                                             list_repeats=3),
                       disk_bytes=512 * 1024**2, disk_s=3.0, decode_s=2.0, images=16, lz4_s=1.0,
                       link_bytes=256 * 1024**2, link_repeats=10, gpu_decode_s=3.0),
}


@dataclass(frozen=True)
class Options:
    """What to diagnose and how the user trains today (the verdict compares against it)."""

    url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    pattern: str | None = None
    mode: str = "default"
    settings: Settings | None = None
    sample_bytes: int | None = None
    image_size: int = 224
    link_payload: str = "fp32"
    decode_on: str = "auto"  # cpu, gpu, none; auto: none where the data is not images, else cpu
    cache: bool = True
    read_threads: int = field(default_factory=default_read_threads)
    step_ms: float | None = None
    batch_size: int | None = None
    gpu: bool = True


def _jpegs(store: dict[str, Any], n: int) -> tuple[list[bytes], str]:
    found = store.pop("_jpegs", None) or []
    if found:
        return found[:n], f"{len(found[:n])} JPEGs from the URL"
    return compute.sample_jpegs(n), f"{n} built-in sample JPEGs (fastload.samples)"


SAMPLE_HEAD_BYTES = 1024**2  # bytes of each non-image file kept for the payload decode probe


def _sample_data(store: dict[str, Any], n: int) -> None:
    """Name the data's kind from its first file's first bytes (under ``data_kind``), and keep up
    to ``n`` samples for the compute probes: the URL's own JPEGs (``_jpegs``), or the first
    bytes of files that are not images (``_raw``). Read through the storage probe's Source
    (``_source``), so on the road it measured."""
    src, sized = store.get("_source"), store.get("_items", [])  # (item as listed, size) of the probe's objects
    if src is None or not sized:
        return

    def heads(items: list[Any], nbytes: int) -> list[bytes]:
        return [bytes(data) for _, data in src.fetch_first_many(items, nbytes)]

    kind = compute.data_kind(heads([sized[0][0]], 512)[0])
    store["data_kind"] = kind
    if kind not in compute.IMAGE_KINDS:
        store["_raw"] = heads([item for item, _ in sized[:n]], SAMPLE_HEAD_BYTES)
        return
    small = [item for item, size in sized if size <= 8 * 1024**2][: 4 * n]
    got: list[bytes] = []
    for k in range(0, len(small), n):  # n at a time: stop reading once n JPEGs are in
        got += [data for data in heads(small[k : k + n], 8 * 1024**2) if compute.is_jpeg(data)]
        if len(got) >= n:
            break
    store["_jpegs"] = got[:n]


def decode_place(opts: Options, kind: str | None) -> str:
    """Where samples are decoded: ``opts.decode_on``, its ``auto`` read from the data's kind
    (no decode for data that is not images; the CPU for images, or built-in samples)."""
    if opts.decode_on != "auto":
        return opts.decode_on
    return "none" if kind is not None and kind not in compute.IMAGE_KINDS else "cpu"


def run_diagnose(opts: Options, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every probe for ``opts`` and return the report (see docs/diagnostics.md).

    ``progress``, when given, is called with the name of each step as it starts.
    """
    t0 = time.perf_counter()
    say = progress or (lambda step: None)
    budget = MODES[opts.mode]
    settings = opts.settings or Settings.from_env()
    report: dict[str, Any] = {"fastload_diagnose": 1, "mode": opts.mode}
    say("environment")
    report["environment"] = guarded("environment", env.environment)
    facts = report["environment"]
    if opts.gpu:
        say("GPU link")
        report["link"] = guarded("link", lambda: link.measure_link(budget.link_bytes, budget.link_repeats))
        report["gpu"] = guarded("gpu", gpu.gpu_devices)
        report["gpu_sanity"] = guarded("gpu_sanity", env.gpu_sanity)
        if report["link"].get("status") == "ok":
            link.attach_classification(report["link"], report["gpu"])
    else:
        for key in ("link", "gpu", "gpu_sanity"):
            report[key] = skipped("GPU probes disabled with --no-gpu")
    say("storage")
    store = guarded("storage", lambda: storage.probe_storage(
        opts.url, opts.storage_options, pattern=opts.pattern, budget=budget.storage, settings=settings))
    if store.get("status") == "ok" and opts.url:
        try:
            _sample_data(store, budget.images)
        except Exception as err:  # the URL's own samples are a nicety; built-in ones stand in
            store["jpeg_fetch_error"] = f"{type(err).__name__}: {err}"
    store.pop("_source", None)
    store.pop("_items", None)
    kind = store.pop("data_kind", None)
    raw = store.pop("_raw", None)
    report["storage"] = store
    say("decode")
    decode_on = decode_place(opts, kind)
    report["data"] = {"status": "ok", "kind": kind or "unknown",
                      "kind_from": "the first bytes of the URL's first file" if kind else "no URL or no file read",
                      "decode_on": decode_on}
    if decode_on == "none":
        why = (f"the data is {kind}, not images: nothing to decode (--decode-on none)" if kind not in compute.IMAGE_KINDS
               else "--decode-on none: nothing is decoded")
        report["images"] = skipped(why)
        report["compute"] = {
            "cpu_decode": skipped(why),
            "payload_decode": guarded("payload_decode", lambda: compute.payload_decode(raw, budget_s=budget.lz4_s, raw_only=True))
            if raw else skipped(why),
            "gpu_decode": skipped(why),
        }
    else:
        _decode_probes(report, opts, budget, store)
    cores = int(facts.get("cpu_usable") or 1)
    sample = opts.sample_bytes or store.get("avg_object_bytes") or DEFAULT_SAMPLE_BYTES
    piece = int(min(max(sample, 4096), 8 * 1024**2))
    say("cache disk")
    report["cache"] = {
        "disk": guarded("disk", lambda: disk.probe_disk(settings, nbytes=budget.disk_bytes, piece_bytes=piece,
                                                        threads=max(4, 2 * cores), budget_s=budget.disk_s)),
        "state": guarded("cache_state", lambda: disk.cache_state(settings, opts.url, opts.storage_options)),
        "index": guarded("cache_index", lambda: disk.probe_index(settings)),
    }
    inputs = build_inputs(report, opts, settings)
    report["verdict"] = make_verdict(inputs).as_dict()
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def _decode_probes(report: dict[str, Any], opts: Options, budget: Budget, store: dict[str, Any]) -> None:
    """The decode probes (``images`` and ``compute``), on the URL's JPEGs or built-in samples."""
    images: dict[str, Any] = {}

    def load_images() -> dict[str, Any]:
        data, where = _jpegs(store, budget.images)
        images["data"] = data
        return {"status": "ok", "source": where, "count": len(data)}

    report["images"] = guarded("images", load_images)
    data = images.get("data")
    cores = int(report["environment"].get("cpu_usable") or 1)
    no_images = skipped(f"no JPEGs to decode: {report['images'].get('reason')}")
    report["compute"] = {
        "cpu_decode": guarded("cpu_decode", lambda: compute.cpu_decode(
            data, image_size=opts.image_size, budget_s=budget.decode_s, threads=cores)) if data else no_images,
        "payload_decode": guarded("payload_decode", lambda: compute.payload_decode(data, budget_s=budget.lz4_s))
        if data else no_images,
        "gpu_decode": (guarded("gpu_decode", lambda: compute.gpu_decode(data, budget_s=budget.gpu_decode_s))
                       if data and opts.gpu else skipped("GPU probes disabled with --no-gpu") if data else no_images),
    }


def _get(section: dict[str, Any], *keys: str) -> Any:
    cur: Any = section
    for k in keys:
        if not isinstance(cur, dict) or cur.get("status", "ok") != "ok":
            return None
        cur = cur.get(k)
    return cur


def _reason(section: dict[str, Any]) -> str:
    return str(section.get("reason") or section.get("status") or "not measured")


def build_inputs(report: dict[str, Any], opts: Options, settings: Settings) -> Inputs:
    """Turn a report's sections into verdict :class:`Inputs` (also used on saved reports)."""
    facts = report.get("environment", {})
    store = report.get("storage", {})
    comp = report.get("compute", {})
    cache = report.get("cache", {})
    links = report.get("link", {})
    if opts.sample_bytes:
        sample, source = float(opts.sample_bytes), "--sample-bytes"
    elif _get(store, "avg_object_bytes"):
        sample, source = float(store["avg_object_bytes"]), f"measured average of {opts.url}"
    else:
        sample, source = float(DEFAULT_SAMPLE_BYTES), "ImageNet-1k average JPEG; pass --sample-bytes or a URL"
    decode_on = (report.get("data") or {}).get("decode_on") or decode_place(opts, None)
    is_jpeg = not opts.sample_bytes or _get(comp, "cpu_decode", "avg_jpeg_bytes") is not None
    payload_row = "raw" if decode_on == "none" else "jpeg" if is_jpeg else "uint8_pixels"
    dev0 = (links.get("devices") or [{}])[0] if links.get("status") == "ok" else {}
    ttfb = _get(store, "ttfb_ms", "median_ms")
    model = None
    if opts.step_ms and opts.batch_size:
        model = opts.batch_size * 1000.0 / opts.step_ms
    torch_facts = facts.get("torch") or {}
    why = {
        "storage": _reason(store),
        "cache_disk": _reason(cache.get("disk", {})),
        "cache_index": _reason(cache.get("index", {})),
        "cache_decode": _reason(comp.get("payload_decode", {})),
        "cpu_decode": _reason(comp.get("cpu_decode", {})),
        "link": _reason(links),
        "gpu_decode": _reason(comp.get("gpu_decode", {})),
        "model": "pass --step-ms and --batch-size",
    }
    return Inputs(
        sample_bytes=sample,
        sample_bytes_source=source,
        image_size=opts.image_size,
        link_payload=opts.link_payload,
        decode_on=decode_on,
        cache=opts.cache,
        dataset_bytes=_get(store, "dataset_bytes"),
        cache_limit_bytes=settings.cache_limit_bytes,
        cached_fraction=_get(cache, "state", "url_cached_fraction"),
        read_threads=opts.read_threads,
        cpu_cores=int(facts.get("cpu_usable") or 1),
        gpu_present=bool(torch_facts.get("cuda_available") or facts.get("gpu_hardware_present")),
        storage_url=opts.url,
        storage_bps=_get(store, "best_bps"),
        storage_connections=_get(store, "saturating_connections"),
        storage_settled=_get(store, "settled_concurrency"),
        storage_one_conn_bps=_get(store, "one_connection_bps"),
        storage_ttfb_s=None if ttfb is None else ttfb / 1e3,
        cache_disk_bps=_get(cache, "disk", "random_cold_bps"),
        cache_index_lookups_s=_get(cache, "index", "lookups_per_s"),
        cache_entries=_get(cache, "index", "entries"),
        cache_decode_bps_per_core=(_get(comp, "payload_decode", payload_row) or {}).get("decode_bps_per_core"),
        cpu_decode_per_core=_get(comp, "cpu_decode", "decode_resize_per_core"),
        h2d_bps=dev0.get("h2d_pinned_bps"),
        h2d_pageable_bps=dev0.get("h2d_pageable_bps"),
        gpu_decode_img_s=_get(comp, "gpu_decode", "img_per_s"),
        model_img_s=model,
        why_missing=why,
    )
