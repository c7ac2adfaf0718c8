"""The human rendering of a diagnose report (``--json`` prints the dict itself)."""

from __future__ import annotations

from typing import Any

from fastload.config import format_size
from fastload.diagnose._util import fmt_bps, fmt_rate
from fastload.diagnose.verdict import Advice, Op, Regime, Verdict

__all__ = ["render", "verdict_from_dict"]


def _why(section: dict[str, Any]) -> str | None:
    """``None`` for a measured section, else ``'skipped: reason'`` / ``'error: reason'``."""
    status = section.get("status", "ok")
    return None if status == "ok" else f"{status}: {section.get('reason')}"


def verdict_from_dict(d: dict[str, Any]) -> Verdict:
    """Rebuild a :class:`Verdict` from its ``as_dict()`` form."""
    return Verdict(
        sample_bytes=d["sample_bytes"],
        sample_bytes_source=d["sample_bytes_source"],
        ops=tuple(Op(**s) for s in d["ops"]),
        cold=Regime(**d["cold"]),
        warm=Regime(**d["warm"]),
        headline=d["headline"],
        bottleneck=d["bottleneck"],
        streams_every_epoch=d["streams_every_epoch"],
        advice=tuple(Advice(**a) for a in d["advice"]),
        notes=tuple(d["notes"]),
    )


def _env(e: dict[str, Any]) -> list[str]:
    if _why(e):
        return [f"  {_why(e)}"]
    torch = e.get("torch") or {}
    if torch.get("installed"):
        cuda = torch.get("cuda") or "none (CPU build)"
        seen = f"{torch.get('device_count')} GPU(s) visible" if torch.get("cuda_available") else "no GPU visible"
        torch_line = f"{torch.get('version')} (CUDA {cuda}; {seen})"
    else:
        torch_line = f"not installed ({torch.get('reason')})"
    drv = e.get("driver") or {}
    drv_line = (f"{drv['version']} (CUDA {drv.get('cuda') or '?'}, via {drv.get('source')})" if drv.get("version")
                else f"none ({drv.get('reason')})")
    dali = e.get("dali")
    dali_line = f"{dali['version']} ({dali['distribution']}, CUDA {dali['cuda_major']})" if dali else "not installed"
    pkgs = e.get("packages") or {}
    keys = ("fsspec", "aiohttp", "s3fs", "gcsfs", "lz4", "pillow", "nvidia-ml-py", "matplotlib")
    pkg_line = ", ".join(f"{k} {pkgs.get(k, '-')}" for k in keys)
    pil = e.get("pillow") or {}
    lines = [
        f"  os        {e.get('os')}, kernel {e.get('kernel')}, {e.get('machine')}",
        f"  cpu       {e.get('cpu_model')}: {e.get('cpu_usable')} usable of {e.get('cpu_count')} cores",
        f"  ram       {format_size(e.get('ram_bytes'))} ({format_size(e.get('ram_available_bytes'))} available)",
        f"  python    {e.get('python')}",
        f"  torch     {torch_line}",
        f"  driver    {drv_line}",
        f"  dali      {dali_line}",
        f"  pillow    {pil.get('version', '-')}" + (" (libjpeg-turbo)" if pil.get("libjpeg_turbo") else ""),
        f"  packages  {pkg_line}",
    ]
    lines += [f"  warning: {w}" for w in e.get("warnings", [])]
    return lines


def _gpu(report: dict[str, Any]) -> list[str]:
    g, sanity, link = report.get("gpu", {}), report.get("gpu_sanity", {}), report.get("link", {})
    lines = []
    if _why(g):
        lines.append(f"  nvml      {_why(g)}")
    for d in g.get("devices", []):
        p, c = d.get("pcie", {}), d.get("clocks_mhz", {})
        lines.append(f"  gpu {d['index']}     {d.get('name')}: memory {format_size(d.get('memory_used_bytes'))} used of "
                     f"{format_size(d.get('memory_total_bytes'))}; PCIe Gen{p.get('gen_current')} x{p.get('width_current')} "
                     f"(max Gen{p.get('gen_max')} x{p.get('width_max')})")
        util = d.get("utilization_pct") or {}
        lines.append(f"            {d.get('temperature_c')} C, {d.get('power_w')} W of {d.get('power_limit_w')} W, "
                     f"SM {c.get('sm')}/{c.get('sm_max')} MHz, util {util.get('gpu')}%, "
                     f"throttle: {', '.join(d.get('throttle_reasons') or []) or 'none'}")
    lines.append(f"  sanity    {_why(sanity) or ('matmul ok on every device' if sanity.get('all_ok') else sanity)}")
    if _why(link):
        lines.append(f"  link      {_why(link)}")
    for d in link.get("devices", []):
        lines.append(f"  link {d['index']}    H2D pinned {fmt_bps(d['h2d_pinned_bps'])}, pageable {fmt_bps(d['h2d_pageable_bps'])}; "
                     f"D2H pinned {fmt_bps(d['d2h_pinned_bps'])}, pageable {fmt_bps(d['d2h_pageable_bps'])}")
        loaded = d.get("pcie_under_load") or {}
        if loaded.get("gen"):
            lines.append(f"            PCIe Gen{loaded['gen']} x{loaded.get('width')} while copying (NVML)")
        cls = d.get("classification") or {}
        if cls:
            lines.append(f"            looks like {cls.get('band')}" + ("; eGPU suspected" if cls.get("egpu_suspected") else ""))
            lines += [f"            - {ev}" for ev in cls.get("evidence", [])]
    return lines


def _storage(s: dict[str, Any]) -> list[str]:
    if _why(s):
        return [f"  {_why(s)}"]
    lst = s.get("listing", {})
    lines = []
    road = s.get("road")
    if road:  # which road the requests took, as training's do (storage.road_of)
        later = f" (later blocks: {road['later_blocks']})" if road.get("later_blocks") else ""
        lines.append(f"  road        {road['name']}{later}: {road['why']}")
    if lst.get("status") == "ok":
        lines.append(f"  listing     {lst['items']} objects in {lst['seconds']:.3f} s ({fmt_rate(lst.get('items_per_s'))}/s)")
    else:
        lines.append(f"  listing     {_why(lst)}")
    lines.append(f"  objects     {s['objects']}, avg {format_size(s['avg_object_bytes'])}, dataset "
                 f"{'' if s['dataset_bytes_exact'] else '~'}{format_size(s['dataset_bytes'])} (sizes from {s['sizes_from']})")
    t = s["ttfb_ms"]
    lines.append(f"  TTFB        median {t['median_ms']:.1f} ms, p90 {t['p90_ms']:.1f} ms ({t['n']} requests)")
    levels = "; ".join(f"{lv['connections']}: {fmt_bps(lv['bytes_per_s'])}" for lv in s["levels"])
    lines.append(f"  throughput  by connections {levels}")
    conns = s["saturating_connections"]
    lines.append(f"              best {fmt_bps(s['best_bps'])}, saturates at {conns} "
                 f"connection{'' if conns == 1 else 's'}; 1 connection {fmt_bps(s['one_connection_bps'])}")
    return lines


def _cache(c: dict[str, Any]) -> list[str]:
    st, dk = c.get("state", {}), c.get("disk", {})
    lines = []
    if _why(st):
        lines.append(f"  state       {_why(st)}")
    elif not st.get("exists"):
        lines.append(f"  state       {st['path']}: empty (not created yet)")
    else:
        frac = st.get("url_cached_fraction")
        url = "" if frac is None else f"; this URL {frac:.0%} cached"
        lines.append(f"  state       {st['path']}: {st['entries']} entries, {format_size(st['stored_bytes'])} of "
                     f"{format_size(st['limit_bytes'])} limit, {st['manifests']} dataset(s), "
                     f"{st['corrupt_dropped']} corrupt dropped{url}")
    ix = c.get("index", {})
    if ix:
        lines.append(f"  index       {_why(ix)}" if _why(ix) else
                     f"  index       {fmt_rate(ix['lookups_per_s'])} look-ups/s ({ix['looked_up']} of "
                     f"{ix['entries']:,} entries, batches of {ix['batch']}, one thread)")
    if _why(dk):
        lines.append(f"  disk        {_why(dk)}")
    else:
        lines.append(f"  disk        sequential cold {fmt_bps(dk['seq_cold_bps'])}, hot {fmt_bps(dk['seq_hot_bps'])}; "
                     f"random {format_size(dk['random_piece_bytes'])} reads x {dk['random_threads']} threads cold "
                     f"{fmt_bps(dk['random_cold_bps'])}")
        if dk.get("note"):
            lines.append(f"              note: {dk['note']}")
    return lines


def _compute(report: dict[str, Any]) -> list[str]:
    c = report.get("compute", {})
    img = report.get("images", {})
    data = report.get("data", {})
    lines = [f"  data        {data['kind']} ({data['kind_from']}); decode on {data['decode_on']}"] if data else []
    lines.append(f"  images      {img.get('source') if img.get('status') == 'ok' else _why(img)}")
    cpu = c.get("cpu_decode", {})
    if _why(cpu):
        lines.append(f"  CPU decode  {_why(cpu)}")
    else:
        w, h = cpu["width_height"]
        scale = ""
        if cpu.get("decode_resize_all_threads"):
            scale = (f"; {cpu['threads']} threads {fmt_rate(cpu['decode_resize_all_threads'])} img/s "
                     f"({cpu['thread_scaling']:.1f}x)")
        lines.append(f"  CPU decode  {fmt_rate(cpu['decode_per_core'])} img/s/core decode only, "
                     f"{fmt_rate(cpu['decode_resize_per_core'])} with resize to {cpu['resize_to']}{scale} "
                     f"({w}x{h}, avg {format_size(cpu['avg_jpeg_bytes'])})")
    pay = c.get("payload_decode", {})
    if _why(pay):
        lines.append(f"  LZ4 decode  {_why(pay)}")
    else:
        rows = [f"{name}: {r['stored_as']} x{r['ratio']:.2f}, {fmt_bps(r['decode_bps_per_core'])}/core"
                for name, r in pay.items() if isinstance(r, dict)]
        lines.append(f"  LZ4 decode  {'; '.join(rows)} (codec.decode, checksum on)")
    g = c.get("gpu_decode", {})
    lines.append(f"  GPU decode  {_why(g) or fmt_rate(g['img_per_s']) + ' img/s (' + g['backend'] + ')'}")
    return lines


def render(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    out = [f"fastload diagnose ({report['mode']}, {report.get('seconds', 0):.1f} s)", "", "environment"]
    out += _env(report.get("environment", {}))
    out += ["", "gpu"] + _gpu(report)
    store = report.get("storage", {})
    out += ["", f"storage {store.get('url', '')}".rstrip()] + _storage(store)
    out += ["", "cache"] + _cache(report.get("cache", {}))
    out += ["", "compute"] + _compute(report)
    out += ["", "verdict"] + ["  " + line if line else "" for line in verdict_from_dict(report["verdict"]).lines()]
    return "\n".join(out)
