"""What a corpus is made of: documents and bytes by source file, language, URL host and length
bucket, counted by the executor before and after every step (the composition report).

Counts live in each step's stats as flat {"<dimension>=<value>": n} maps (`comp_docs_in`,
`comp_bytes_in`, `comp_docs_kept`, `comp_bytes_kept`) so `merge_stats` sums them across shards.
Per shard and step at most `MAX_VALUES` distinct values of a dimension are kept; later new
values count as "(other)" (a web crawl has millions of hosts), so the tail is exact in total,
not by value. Language is `meta["language"]` (set by the `language` step; "(unknown)" before
it); the host is `urllib.parse.urlsplit(meta["url"]).hostname` ("(no url)", "(empty url)",
"(bad url)" when that fails).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

DIMENSIONS = ("source", "language", "host", "length")
MAX_VALUES = 256
OTHER = "(other)"
# Length buckets by UTF-8 bytes: (upper bound exclusive, label).
LENGTH_BUCKETS = ((256, "<256 B"), (1024, "256 B-1 KiB"), (4096, "1-4 KiB"), (16384, "4-16 KiB"),
                  (65536, "16-64 KiB"), (1 << 62, ">=64 KiB"))


def length_bucket(n_bytes: int) -> str:
    for bound, label in LENGTH_BUCKETS:
        if n_bytes < bound:
            return label
    return LENGTH_BUCKETS[-1][1]


def url_host(meta: dict[str, Any], url_field: str = "url") -> str:
    url = meta.get(url_field)
    if url is None:
        return "(no url)"
    if not isinstance(url, str) or not url.strip():
        return "(empty url)"
    try:
        host = urlsplit(url.strip() if "//" in url else "//" + url.strip()).hostname
    except ValueError:  # e.g. an invalid IPv6 literal
        return "(bad url)"
    return host.rstrip(".") if host else "(bad url)"


def doc_values(meta: dict[str, Any], n_bytes: int) -> tuple[str, str, str, str]:
    """(source, language, host, length bucket) of one document."""
    source = meta.get("source")
    language = meta.get("language")
    return (str(source) if source is not None else "(none)",
            str(language) if isinstance(language, str) and language else "(unknown)",
            url_host(meta), length_bucket(n_bytes))


class CompositionCounter:
    """Adds documents to one step's `comp_docs_<key>` / `comp_bytes_<key>` maps, capped per dimension."""

    def __init__(self, stats: dict[str, Any], key: str):
        self.docs = stats.setdefault(f"comp_docs_{key}", {})
        self.bytes = stats.setdefault(f"comp_bytes_{key}", {})
        self.seen: dict[str, set[str]] = {d: set() for d in DIMENSIONS}

    def add(self, meta: dict[str, Any], n_bytes: int) -> None:
        for dim, value in zip(DIMENSIONS, doc_values(meta, n_bytes)):
            seen = self.seen[dim]
            if value not in seen:
                if len(seen) >= MAX_VALUES:
                    value = OTHER
                else:
                    seen.add(value)
            k = f"{dim}={value}"
            self.docs[k] = self.docs.get(k, 0) + 1
            self.bytes[k] = self.bytes.get(k, 0) + n_bytes


def composition_table(stats: dict[str, Any], top: int = 20) -> dict[str, list[dict[str, Any]]]:
    """{dimension: [{"value", "docs_in", "bytes_in", "docs_kept", "bytes_kept"}]} of one step,
    largest first (by bytes in), the top `top` values and the rest summed as "(other)"."""
    maps = {k: stats.get(f"comp_{k}", {}) for k in ("docs_in", "bytes_in", "docs_kept", "bytes_kept")}
    tables: dict[str, list[dict[str, Any]]] = {}
    for dim in DIMENSIONS:
        prefix = f"{dim}="
        values = {k[len(prefix):] for m in maps.values() for k in m if k.startswith(prefix)}
        rows = [{"value": v, **{name: m.get(prefix + v, 0) for name, m in maps.items()}} for v in values]
        rows.sort(key=lambda r: (-r["bytes_in"], -r["docs_in"], r["value"]))
        if len(rows) > top:
            rest = rows[top:]
            rows = rows[:top] + [{"value": OTHER, **{name: sum(r[name] for r in rest) for name in maps}}]
        tables[dim] = rows
    return tables
