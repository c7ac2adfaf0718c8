"""The verdict: each op's max samples/s, the op that limits, and what to change.

Pure arithmetic over measurements (no probes run here), so every bottleneck
class is unit-tested with synthetic numbers (``tests/unit/test_verdict.py``).

The model. A sample of ``sample_bytes`` (the encoded file, e.g. a ~108 KB JPEG)
flows through ops, each with a ceiling in samples/s:

===============  ======================================================  ===========
op               ceiling                                                 epochs
===============  ======================================================  ===========
``storage``      remote bytes/s at the saturating concurrency / size     cold [1]_
``cache_disk``   local cache disk bytes/s / size                         warm
``cache_index``  the cache index's look-ups/s (one per sample, measured  warm
                 on the cache as it is: its entries, its disk)
``cache_decode`` payload decode (LZ4 or raw + xxh3) bytes/s x cores      warm
``cpu_decode``   JPEG decode img/s per core x cores (decode on CPU)      all
``link``         pinned H2D bytes/s / bytes sent per sample              all
``gpu_decode``   GPU decode img/s (decode on GPU)                        all
``model``        the training step's img/s (``--step-ms``)               all
===============  ======================================================  ===========

.. [1] Every epoch when the cache is off or smaller than the dataset.

What crosses the GPU link depends on where decoding happens: decoded images
(``fp32``/``fp16``/``uint8`` at ``image_size`` squared, 3 channels) when the CPU
decodes, the JPEG itself when the GPU does.

The slowest op in a regime is its limit. A regime is cold or warm by its cache
hit rate (:func:`fastload.stats.regime`, the one definition): epoch 1 is cold (from
storage) unless the URL is mostly cached already, epochs 2+ are warm (from the
cache) unless every epoch streams. The headline is the warm regime, unless every epoch streams from storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fastload import stats
from fastload.config import Settings, format_size
from fastload.diagnose._util import fmt_bps, fmt_rate

__all__ = ["PAYLOADS", "Advice", "Inputs", "Regime", "Op", "Verdict", "make_verdict", "payload_bytes"]

PAYLOADS = ("fp32", "fp16", "uint8", "jpeg")
DECODE_PLACES = ("cpu", "gpu", "none")  # none: the data is not images (arrays, tokens), shipped as stored
_ITEMSIZE = {"fp32": 4, "fp16": 2, "uint8": 1}
CLASS_OF = {
    "storage": "storage",
    "cache_disk": "disk",
    "cache_index": "index",
    "cache_decode": "cpu",
    "cpu_decode": "cpu",
    "link": "link",
    "gpu_decode": "gpu",
    "model": "compute",
}
DEFAULT_READ_THREADS = 8  # Inputs' default: fastload.config.default_read_threads() on 8 or more CPUs
CLOSE = 1.15  # two ops within 15% of each other are "balanced"
#: A100 + DALI mixed decode, about 7,000 img/s (DALI's A100 blog, quoted in NVIDIA/DALI issue 5362),
#: quoted when unmeasured.
REFERENCE_GPU_DECODE = 7000.0
#: OCuLink / PCIe 4.0 x4 pinned H2D, about 6.6 GB/s (github.com/procrastineto/GPU-PCIe-Test issue 3).
REFERENCE_FAST_LINK = 6.6e9


def payload_bytes(payload: str, sample_bytes: float, image_size: int) -> float:
    """Bytes per sample that cross the GPU link for ``payload`` (``jpeg``, ``raw``: the file itself).

    >>> payload_bytes("fp32", 108_000, 224), payload_bytes("jpeg", 108_000, 224)
    (602112.0, 108000.0)
    """
    if payload in ("jpeg", "raw"):
        return float(sample_bytes)
    if payload not in _ITEMSIZE:
        raise ValueError(f"payload {payload!r} is not one of {', '.join(PAYLOADS)}")
    return float(image_size * image_size * 3 * _ITEMSIZE[payload])


@dataclass(frozen=True)
class Inputs:
    """Measurements and the user's current settings; None = not measured.

    Rates are bytes/s unless named ``img_s``/``per_core`` (images/s). ``why_missing``
    maps a op name to the reason it was not measured (shown in the table).
    """

    sample_bytes: float
    sample_bytes_source: str = "given"
    image_size: int = 224
    link_payload: str = "fp32"
    decode_on: str = "cpu"
    cache: bool = True
    dataset_bytes: float | None = None
    cache_limit_bytes: float | None = None
    cached_fraction: float | None = None
    read_threads: int = DEFAULT_READ_THREADS
    cpu_cores: int = 1
    gpu_present: bool | None = None
    storage_url: str | None = None
    storage_bps: float | None = None
    storage_connections: int | None = None
    storage_settled: Mapping[str, Any] | None = None  # fastload's request limit there: limit, cap, peak, cuts
    storage_one_conn_bps: float | None = None
    storage_ttfb_s: float | None = None
    cache_disk_bps: float | None = None
    cache_index_lookups_s: float | None = None  # the cache's own index, one process (GIL-bound)
    cache_entries: int | None = None
    cache_decode_bps_per_core: float | None = None
    cpu_decode_per_core: float | None = None
    h2d_bps: float | None = None
    h2d_pageable_bps: float | None = None
    gpu_decode_img_s: float | None = None
    model_img_s: float | None = None
    why_missing: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Op:
    """One row of the table."""

    name: str
    label: str
    samples_per_s: float | None
    detail: str
    epochs: str  # "cold", "warm" or "all"
    in_path: bool = True  # False: listed for comparison, not on the data path


@dataclass(frozen=True)
class Regime:
    """The limit of one regime: ``cold`` (epoch 1, from storage) or ``warm`` (from the cache)."""

    name: str
    limit: str | None  # op name
    bottleneck: str | None  # class: storage, disk, index, cpu, link, gpu, compute
    samples_per_s: float | None
    sentence: str


@dataclass(frozen=True)
class Advice:
    """A concrete setting to change, its value, and the numbers behind it."""

    setting: str
    value: str
    why: str


@dataclass(frozen=True)
class Verdict:
    """The whole verdict; ``lines()`` renders it for humans, ``as_dict()`` for JSON."""

    sample_bytes: float
    sample_bytes_source: str
    ops: tuple[Op, ...]
    cold: Regime
    warm: Regime
    headline: str
    bottleneck: str | None
    streams_every_epoch: bool
    advice: tuple[Advice, ...]
    notes: tuple[str, ...]

    def op(self, name: str) -> Op:
        """The row of op ``name`` (KeyError for an unknown name)."""
        for s in self.ops:
            if s.name == name:
                return s
        raise KeyError(f"no op {name!r}; ops are {', '.join(s.name for s in self.ops)}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The table, the limit per regime, the advice and the notes, as text lines."""
        rows = [("op", "max samples/s", "measured", "epochs")]
        for s in self.ops:
            rate = fmt_rate(s.samples_per_s) if s.samples_per_s is not None else "-"
            rows.append((s.label + ("" if s.in_path else " (not in path)"), rate, s.detail, s.epochs))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        out = [f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:<{w[2]}}  {r[3]}".rstrip() for r in rows]
        out.append("")
        out.append(f"sample size {format_size(self.sample_bytes)} ({self.sample_bytes_source})")
        if self.streams_every_epoch:
            out.append(f"every epoch: {self.cold.sentence}")
        else:
            out.append(f"epoch 1 (cold): {self.cold.sentence}")
            out.append(f"epochs 2+ (warm): {self.warm.sentence}")
        out.append(f"verdict: {self.headline}")
        if self.advice:
            out.append("")
            out.append("change:")
            out.extend(f"  - {a.setting}: {a.value}. {a.why[0].upper()}{a.why[1:]}" for a in self.advice)
        if self.notes:
            out.append("")
            out.extend(f"note: {n}" for n in self.notes)
        return out


# -- ops -------------------------------------------------------------------------


def _ops(x: Inputs) -> list[Op]:
    size = x.sample_bytes
    miss = x.why_missing
    on_gpu = x.decode_on == "gpu"
    payload = _link_payload(x)
    ops = []

    def add(name: str, label: str, rate: float | None, detail: str, epochs: str, in_path: bool = True) -> None:
        if rate is None:
            detail = f"not measured: {_short(miss.get(name, 'no measurement'))}"
        ops.append(Op(name, label, rate, detail, epochs, in_path))

    cold_epochs = "all" if _streams(x) else "cold"
    if x.storage_bps is not None:
        conn = f" at {_n(x.storage_connections, 'connection')}" if x.storage_connections else ""
        ttfb = f", TTFB {x.storage_ttfb_s * 1e3:.1f} ms" if x.storage_ttfb_s is not None else ""
        add("storage", "remote storage", x.storage_bps / size, f"{fmt_bps(x.storage_bps)}{conn}{ttfb}", cold_epochs)
    else:
        add("storage", "remote storage", None, "", cold_epochs)
    warm_in_path = not _streams(x)
    rate = x.cache_disk_bps / size if x.cache_disk_bps else None
    add("cache_disk", "cache disk read", rate, f"{fmt_bps(x.cache_disk_bps)}", "warm", warm_in_path)
    entries = f" over {x.cache_entries:,} entries" if x.cache_entries is not None else ""
    add("cache_index", "cache index look-up", x.cache_index_lookups_s,
        f"{fmt_rate(x.cache_index_lookups_s)} look-ups/s{entries}", "warm", warm_in_path)
    rate = x.cache_decode_bps_per_core * x.cpu_cores / size if x.cache_decode_bps_per_core else None
    add("cache_decode", "cache payload decode", rate,
        f"{fmt_bps(x.cache_decode_bps_per_core)}/core x {x.cpu_cores}", "warm", warm_in_path)
    rate = x.cpu_decode_per_core * x.cpu_cores if x.cpu_decode_per_core else None
    add("cpu_decode", "CPU JPEG decode", rate,
        f"{fmt_rate(x.cpu_decode_per_core)} img/s/core x {x.cpu_cores} cores", "all", x.decode_on == "cpu")
    per = payload_bytes(payload, size, x.image_size)
    rate = x.h2d_bps / per if x.h2d_bps else None
    add("link", f"GPU link ({_payload_name(payload, x.image_size)})", rate,
        f"{fmt_bps(x.h2d_bps)} pinned H2D, {format_size(per)}/sample", "all")
    add("gpu_decode", "GPU JPEG decode", x.gpu_decode_img_s,
        f"{fmt_rate(x.gpu_decode_img_s)} img/s", "all", on_gpu)
    add("model", "model step", x.model_img_s, f"{fmt_rate(x.model_img_s)} img/s", "all")
    return ops


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _short(reason: str) -> str:
    """The first clause of a skip reason, for a table cell (the section above has it all)."""
    for sep in (": ", "; ", " ("):
        head = reason.split(sep, 1)[0]
        if len(head) <= 48:
            return head
    return reason[:45] + "..."


def _payload_name(payload: str, hw: int) -> str:
    return "JPEG" if payload == "jpeg" else "samples as stored" if payload == "raw" else f"{payload} {hw}x{hw}"


def _link_payload(x: Inputs) -> str:
    """What crosses the link: the JPEG (GPU decode), the sample as stored (no decode), else ``link_payload``."""
    return "jpeg" if x.decode_on == "gpu" else "raw" if x.decode_on == "none" else x.link_payload


def _streams(x: Inputs) -> bool:
    """True when every epoch reads from storage: cache off, or a dataset larger than it."""
    too_big = x.dataset_bytes is not None and x.cache_limit_bytes is not None and x.dataset_bytes > x.cache_limit_bytes
    return not x.cache or too_big


def _limit(ops: list[Op], regime: str) -> Op | None:
    want = {"cold": ("cold", "all"), "warm": ("warm", "all")}[regime]
    live = [s for s in ops if s.in_path and s.epochs in want and s.samples_per_s is not None]
    return min(live, key=lambda s: s.samples_per_s or 0.0) if live else None


def _data_limit(ops: list[Op], regime: str) -> Op | None:
    return _limit([s for s in ops if s.name != "model"], regime)


# -- sentences ----------------------------------------------------------------------


def _sentence(x: Inputs, ops: list[Op], s: Op | None, regime: str) -> str:
    if s is None:
        return "no op on this path was measured"
    rate = fmt_rate(s.samples_per_s)
    size = format_size(x.sample_bytes)
    if s.name == "storage":
        where = x.storage_url or "storage"
        conn = f" with {_n(x.storage_connections, 'connection')}" if x.storage_connections else ""
        return f"storage-bound: {fmt_bps(x.storage_bps)} from {where}{conn} caps {size} samples at {rate} img/s"
    if s.name == "cache_disk":
        return f"disk-bound: the cache disk reads {fmt_bps(x.cache_disk_bps)}, capping {size} samples at {rate} img/s"
    if s.name == "cache_index":
        entries = f" of {x.cache_entries:,} entries" if x.cache_entries is not None else ""
        return (f"index-bound: the cache's index{entries} answers {fmt_rate(x.cache_index_lookups_s)} look-ups/s, "
                f"one per sample, capping warm epochs at {rate} img/s")
    if s.name == "cache_decode":
        return (f"CPU-bound: payload decode at {fmt_bps(x.cache_decode_bps_per_core)} per core x "
                f"{x.cpu_cores} cores caps {size} samples at {rate} img/s")
    if s.name == "cpu_decode":
        return (f"CPU-bound: JPEG decode at {fmt_rate(x.cpu_decode_per_core)} img/s per core x "
                f"{x.cpu_cores} cores caps at {rate} img/s")
    if s.name == "link":
        payload = _link_payload(x)
        text = f"link-bound: {fmt_bps(x.h2d_bps)} H2D caps {_payload_name(payload, x.image_size)} at {rate} img/s"
        better = _better_payload(x, payload)
        if better is not None:
            name, how, r = better
            text += f"; {how} for about {fmt_rate(r)}"
        return text
    if s.name == "gpu_decode":
        return f"GPU-decode-bound: the GPU decodes {rate} img/s"
    data = _data_limit(ops, regime)
    if data is None:
        return f"compute-bound: the model takes {rate} img/s (no data op was measured)"
    room = (data.samples_per_s or 0.0) / (s.samples_per_s or 1.0)
    return (f"compute-bound: the model takes {rate} img/s and the slowest data op "
            f"({data.label}) delivers {fmt_rate(data.samples_per_s)} ({room:.1f}x headroom); "
            "the input pipeline is not the limit")


def _better_payload(x: Inputs, payload: str) -> tuple[str, str, float] | None:
    if not x.h2d_bps:
        return None
    if payload in ("fp32", "fp16"):
        r = x.h2d_bps / payload_bytes("uint8", x.sample_bytes, x.image_size)
        return "uint8", "ship uint8 and normalise on GPU (pipeline dtype='uint8')", r
    if payload == "uint8" and x.sample_bytes < payload_bytes("uint8", x.sample_bytes, x.image_size):
        r = x.h2d_bps / x.sample_bytes
        return "jpeg", "ship the JPEG and decode on the GPU (fastload.pipelines, device='cuda')", r
    return None


# -- advice -------------------------------------------------------------------------


def _advice(x: Inputs, ops: list[Op], s: Op, regime: str, warm: Op | None) -> list[Advice]:
    rate = fmt_rate(s.samples_per_s)
    out: list[Advice] = []
    if s.name == "storage":
        if not x.cache:
            tail = f"; epochs 2+ then run at the warm limit, {fmt_rate(warm.samples_per_s)} img/s" if warm else ""
            out.append(Advice("cache", "on (the default)", f"storage caps every epoch at {rate} img/s{tail}"))
        elif _streams(x):
            out.append(Advice("FASTLOAD_CACHE_LIMIT / --cache-limit", f">= {format_size((x.dataset_bytes or 0) * 1.1)}",
                              f"the dataset ({format_size(x.dataset_bytes)}) is larger than the cache limit "
                              f"({format_size(x.cache_limit_bytes)}), so every epoch streams at {rate} img/s"))
        conn = x.storage_connections
        if conn and conn > x.read_threads and x.storage_one_conn_bps and x.storage_bps:
            at = min(x.storage_bps, x.read_threads * x.storage_one_conn_bps) / x.sample_bytes
            if at < 0.9 * (s.samples_per_s or 0.0):
                out.append(Advice("read_threads", str(conn),
                                  f"storage saturates at {conn} concurrent requests; read_threads={x.read_threads} "
                                  f"reaches about {fmt_rate(at)} img/s of {rate}"))
        if x.cache and x.cached_fraction != 1.0:
            url = x.storage_url or "URL"
            cap = (x.storage_settled or {}).get("cap") or Settings().max_requests  # this process's cap per host
            workers = f" --max-requests {conn}" if conn and conn > cap else ""
            cost = ""
            if x.dataset_bytes and x.storage_bps:
                cost = f"; it moves {format_size(x.dataset_bytes)} once, about {_duration(x.dataset_bytes / x.storage_bps)}"
            later = f", then every epoch runs at {fmt_rate(warm.samples_per_s)} img/s" if warm and not _streams(x) else ""
            out.append(Advice("pre-stage", f"fastload cache {url}{workers}",
                              f"epoch 1 otherwise streams at {rate} img/s{later}{cost}"))
        if x.storage_ttfb_s and x.storage_ttfb_s > 0.005 and x.sample_bytes < 4e6 and x.storage_one_conn_bps:
            per_conn = x.storage_one_conn_bps / x.sample_bytes
            out.append(Advice("data layout", "tar shards of 64 MB or more (fastload.TarDataset)",
                              f"each request waits {x.storage_ttfb_s * 1e3:.0f} ms for its first byte and moves "
                              f"only {format_size(x.sample_bytes)}, so one connection does {fmt_rate(per_conn)} img/s"))
    elif s.name == "cache_disk":
        out.append(Advice("FASTLOAD_CACHE_DIR", "a faster local disk (NVMe)",
                          f"the cache disk reads {fmt_bps(x.cache_disk_bps)}, capping warm epochs at {rate} img/s"))
        if x.storage_bps and x.cache_disk_bps and x.storage_bps > x.cache_disk_bps:
            out.append(Advice("cache", "off (read the remote directly)",
                              f"the remote ({fmt_bps(x.storage_bps)}) is faster than the cache disk "
                              f"({fmt_bps(x.cache_disk_bps)}), so caching slows later epochs down"))
    elif s.name == "cache_index":
        out.append(Advice("data layout", "tar shards of 64 MB or more (fastload.TarDataset)",
                          f"each sample costs one index look-up ({fmt_rate(x.cache_index_lookups_s)}/s here); a shard's "
                          "samples share its blocks' few look-ups"))
        out.append(Advice("DataLoader", "num_workers >= 2",
                          "look-ups run in Python under one process's GIL: more read threads do not add to them, "
                          "worker processes do"))
    elif s.name == "cache_decode":
        out.append(Advice("FASTLOAD_LZ4_LEVEL / payloads", "raw (incompressible data) or LZ4 inflated on the GPU",
                          f"decoding cached payloads on {x.cpu_cores} cores caps at {rate} img/s"))
    elif s.name == "cpu_decode":
        gpu = x.gpu_decode_img_s
        if x.gpu_present is False:
            out.append(Advice("pipeline placement", "decode on a GPU (fastload.pipelines, device='cuda')",
                              f"CPU JPEG decode caps at {rate} img/s on {x.cpu_cores} cores and this machine has no "
                              "usable GPU; on a GPU machine decode there"))
        else:
            got = (f"this GPU decodes {fmt_rate(gpu)} img/s" if gpu else
                   f"not measured here; an A100 decodes about {fmt_rate(REFERENCE_GPU_DECODE)} img/s with DALI")
            out.append(Advice("pipeline placement", "decode on the GPU (fastload.pipelines, device='cuda')",
                              f"CPU JPEG decode caps at {rate} img/s; GPU decode: {got}; the link then carries "
                              "JPEG, the smallest payload"))
        if x.read_threads < x.cpu_cores:
            out.append(Advice("read_threads / num_workers", f"{x.cpu_cores} or more",
                              f"decode on all {x.cpu_cores} cores in parallel; read_threads={x.read_threads} "
                              "uses fewer (Pillow releases the GIL, so threads scale)"))
    elif s.name == "link":
        payload = _link_payload(x)
        better = _better_payload(x, payload)
        if better is not None:
            name, how, r = better
            out.append(Advice("link payload", name, f"{how}: about {fmt_rate(r)} img/s instead of {rate}"))
        else:
            r = REFERENCE_FAST_LINK / payload_bytes(payload, x.sample_bytes, x.image_size)
            out.append(Advice("GPU link", "a faster link (OCuLink / PCIe x16)",
                              f"the link already carries the smallest payload; a {fmt_bps(REFERENCE_FAST_LINK)} "
                              f"link would give about {fmt_rate(r)} img/s"))
        if x.h2d_pageable_bps and x.h2d_bps and x.h2d_pageable_bps < 0.7 * x.h2d_bps:
            out.append(Advice("device", "'cuda' (pinned, double-buffered copies)",
                              f"pageable copies reach {fmt_bps(x.h2d_pageable_bps)} against {fmt_bps(x.h2d_bps)} pinned"))
        out.append(Advice("prefetch_to_device", "3", "keep one more copy in flight while the step computes"))
    elif s.name == "gpu_decode":
        cpu = x.cpu_decode_per_core * x.cpu_cores if x.cpu_decode_per_core else None
        extra = f" (the CPU adds about {fmt_rate(cpu)} img/s)" if cpu else ""
        out.append(Advice("decode split", "decode part of each batch on CPU threads",
                          f"the GPU decodes {rate} img/s{extra}; DALI's hw_decoder_load=0.65 also balances "
                          "the hardware and CUDA decoders"))
    elif s.name == "model":
        data = _data_limit(ops, regime)
        if data is not None:
            room = (data.samples_per_s or 0.0) / (s.samples_per_s or 1.0)
            out.append(Advice("data pipeline", "no change needed",
                              f"the model takes {rate} img/s and the data path delivers {fmt_rate(data.samples_per_s)} "
                              f"({room:.1f}x); speed the step up instead (AMP, channels_last, a larger batch)"))
            if room < 1.3:
                out.append(Advice("prefetch_to_device", "3",
                                  f"only {room:.1f}x headroom over {data.label}: a deeper queue absorbs jitter"))
    return out


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- the verdict --------------------------------------------------------------------


def make_verdict(x: Inputs) -> Verdict:
    """Build the :class:`Verdict` for ``x``.

    Example: an eGPU link fed normalised fp32 images by 16 fast CPU cores.

    >>> v = make_verdict(Inputs(sample_bytes=110e3, h2d_bps=2.6e9, cpu_decode_per_core=2000, cpu_cores=16))
    >>> v.bottleneck, v.headline.split(";")[0]
    ('link', 'link-bound: 2.6 GB/s H2D caps fp32 224x224 at 4,300 img/s')
    >>> [(a.setting, a.value) for a in v.advice][:1]
    [('link payload', 'uint8')]

    Raises:
        ValueError: ``sample_bytes`` is not positive, or a payload/placement is unknown.
    """
    if not x.sample_bytes or x.sample_bytes <= 0:
        raise ValueError(f"sample_bytes={x.sample_bytes!r} must be positive")
    if x.decode_on not in DECODE_PLACES:
        raise ValueError(f"decode_on={x.decode_on!r} must be one of {', '.join(DECODE_PLACES)}")
    payload_bytes(x.link_payload, x.sample_bytes, x.image_size)  # validates the payload
    ops = _ops(x)
    streams = _streams(x)
    cold_s = _limit(ops, "cold")
    warm_s = cold_s if streams else _limit(ops, "warm")
    cold = _regime("cold", x, ops, cold_s, "cold")
    warm = _regime("warm", x, ops, warm_s, "cold" if streams else "warm")
    # What epochs 2+ would do with the cache on (quoted by the cache advice).
    warm_if_cached = _limit(_ops(_with_cache(x)), "warm") if streams else warm_s
    head = cold if streams else warm
    head_regime = "cold" if streams else "warm"
    head_s = cold_s if streams else warm_s
    advice: list[Advice] = []
    for regime, s in ((head_regime, head_s), ("cold", cold_s)):
        if s is None:
            continue
        for a in _advice(x, ops, s, regime, warm_if_cached):
            if all(a.setting != b.setting for b in advice):
                advice.append(a)
    notes = _notes(x, ops, head_s, head_regime)
    if not streams and cold_s is not None and cold_s.name == "storage" and stats.regime(x.cached_fraction) == "warm":
        notes.append(f"this URL is already {x.cached_fraction:.0%} cached, so epoch 1 is warm too")
    headline = head.sentence
    return Verdict(
        sample_bytes=float(x.sample_bytes),
        sample_bytes_source=x.sample_bytes_source,
        ops=tuple(ops),
        cold=cold,
        warm=warm,
        headline=headline,
        bottleneck=head.bottleneck,
        streams_every_epoch=streams,
        advice=tuple(advice),
        notes=tuple(notes),
    )


def _regime(name: str, x: Inputs, ops: list[Op], s: Op | None, basis: str) -> Regime:
    if s is None:
        return Regime(name, None, None, None, _sentence(x, ops, None, basis))
    return Regime(name, s.name, CLASS_OF[s.name], s.samples_per_s, _sentence(x, ops, s, basis))


def _with_cache(x: Inputs) -> Inputs:
    return Inputs(**{**{f: getattr(x, f) for f in x.__dataclass_fields__}, "cache": True, "dataset_bytes": None})


def _notes(x: Inputs, ops: list[Op], s: Op | None, regime: str) -> list[str]:
    notes = []
    want = ("cold", "all") if regime == "cold" else ("warm", "all")
    live = sorted((t for t in ops if t.in_path and t.epochs in want and t.samples_per_s is not None),
                  key=lambda t: t.samples_per_s or 0.0)
    if s is not None and len(live) > 1 and (live[1].samples_per_s or 0) <= CLOSE * (live[0].samples_per_s or 0):
        gain = (live[1].samples_per_s or 0) / (live[0].samples_per_s or 1) - 1
        notes.append(f"{live[0].label} and {live[1].label} are within {CLOSE - 1:.0%} of each other: "
                     f"fixing only the first gains at most {gain:.0%}")
    unmeasured = [t.label for t in ops if t.in_path and t.samples_per_s is None and t.name != "model"]
    if unmeasured:
        notes.append(f"not measured, so not considered: {', '.join(unmeasured)}")
    settled = x.storage_settled
    if settled:
        why = (f", cut {_n(settled['cuts'], 'time')} on busy answers or resets" if settled.get("cuts") else
               ", the cap" if settled["limit"] >= settled["cap"] else ", where more stopped paying")
        notes.append(f"fastload's request limit to the storage settled at {settled['limit']} in flight "
                     f"(cap --max-requests {settled['cap']}{why})")
    if x.model_img_s is None:
        notes.append("the model's own rate is unknown; pass --step-ms and --batch-size to include it")
    return notes
