"""fastload.transport.answers.page_links: what a folder page links to below itself, as urljoin resolves it,
and the exact sizes an autoindex page shows (nginx's pages, read from a real nginx, are in
tests/integration/test_http_listing_sizes.py; Apache is not installed, so its pages are written here)."""

from __future__ import annotations

from urllib.parse import urljoin

import pytest

from fastload.transport.answers import PLAIN_LINK as _PLAIN_LINK
from fastload.transport.answers import page_links as _page_links

LINKS = ["00017.jpg", "cls/", "a b.jpg", "a%20b.jpg", "./x.jpg", "../up.jpg", "a/../b.jpg", "a/./b.jpg",
         ".hidden", "/abs/x.jpg", "http://other/x.jpg", "//other/x.jpg", "c:x", "deep/er/x.jpg", ".", "..", "x/.."]


@pytest.mark.parametrize("link", LINKS)
def test_the_fast_join_agrees_with_urljoin(link: str) -> None:
    base = "http://h:8080/train/class_00/"
    if _PLAIN_LINK.match(link):
        assert base + link == urljoin(base, link)
    files, folders = _page_links(base, f'<a href="{link}">x</a>')
    url = urljoin(base, link)
    below = url.startswith(base) and url != base
    assert (set(files) | folders) == ({url} if below else set())
    assert all(size == -1 for size in files.values())  # not an index page: no sizes


def test_plain_names_take_the_fast_join() -> None:
    # The case that costs: an index page of many plain file names (nginx autoindex, http.server).
    assert all(_PLAIN_LINK.match(x) for x in ("00017.jpg", "cls/", "a b.jpg", "deep/er/x.jpg"))
    assert not any(_PLAIN_LINK.match(x) for x in ("./x.jpg", "../up.jpg", "a/../b.jpg", "/abs", "http://o/x", "."))


BASE = "http://data.example.com/train/"

# Apache 2.4's mod_autoindex with Debian's IndexOptions (FancyIndexing HTMLTable ...). Sizes are
# apr_strfsize's: bytes below 973 B ("812 ", " 17 "), else one decimal and a unit ("4.0K", "1.2M").
# An href is the name through ap_os_escape_path (lowercase hex), then HTML-escaped: "&" is "&amp;".
APACHE_TABLE = """<!DOCTYPE HTML PUBLIC "-//W3C//DTD HTML 3.2 Final//EN">
<html>
 <head>
  <title>Index of /train</title>
 </head>
 <body>
<h1>Index of /train</h1>
  <table>
   <tr><th valign="top"><img src="/icons/blank.gif" alt="[ICO]"></th><th><a href="?C=N;O=D">Name</a></th>\
<th><a href="?C=M;O=A">Last modified</a></th><th><a href="?C=S;O=A">Size</a></th><th><a href="?C=D;O=A">Description</a></th></tr>
   <tr><th colspan="5"><hr></th></tr>
<tr><td valign="top"><img src="/icons/back.gif" alt="[PARENTDIR]"></td><td><a href="/">Parent Directory</a></td>\
<td>&nbsp;</td><td align="right">  - </td><td>&nbsp;</td></tr>
<tr><td valign="top"><img src="/icons/folder.gif" alt="[DIR]"></td><td><a href="class_00/">class_00/</a></td>\
<td align="right">2024-01-12 10:00  </td><td align="right">  - </td><td>&nbsp;</td></tr>
<tr><td valign="top"><img src="/icons/image2.gif" alt="[IMG]"></td><td><a href="00017.jpg">00017.jpg</a></td>\
<td align="right">2024-01-12 10:00  </td><td align="right">4.0K</td><td>&nbsp;</td></tr>
<tr><td valign="top"><img src="/icons/text.gif" alt="[TXT]"></td><td><a href="labels.txt">labels.txt</a></td>\
<td align="right">2024-01-12 10:01  </td><td align="right">812 </td><td>&nbsp;</td></tr>
<tr><td valign="top"><img src="/icons/image2.gif" alt="[IMG]"></td><td><a href="a%20b&amp;c%c3%a9.jpg">a b&amp;cé.jpg</a></td>\
<td align="right">2024-01-12 10:02  </td><td align="right"> 17 </td><td>&nbsp;</td></tr>
<tr><td valign="top"><img src="/icons/tar.gif" alt="[   ]"></td><td><a href="shard-000.tar">shard-000.tar</a></td>\
<td align="right">2024-01-12 10:03  </td><td align="right">1.2M</td><td>&nbsp;</td></tr>
<tr><td valign="top"><img src="/icons/unknown.gif" alt="[   ]"></td><td><a href="empty.bin">empty.bin</a></td>\
<td align="right">2024-01-12 10:03  </td><td align="right">  0 </td><td>Zero bytes</td></tr>
   <tr><th colspan="5"><hr></th></tr>
</table>
<address>Apache/2.4.57 (Debian) Server at data.example.com Port 80</address>
</body></html>
"""

# The same server without HTMLTable, with IconsAreLinks: each file is linked twice, its icon first.
# (Apache pads each row with spaces after the size; ruff keeps them out of this file.)
APACHE_PRE = """<html><head><title>Index of /train</title></head><body>
<h1>Index of /train</h1>
<pre><img src="/icons/blank.gif" alt="Icon "> <a href="?C=N;O=D">Name</a>                    \
<a href="?C=M;O=A">Last modified</a>      <a href="?C=S;O=A">Size</a>  <a href="?C=D;O=A">Description</a><hr>\
<a href="/"><img src="/icons/back.gif" alt="[PARENTDIR]"></a> <a href="/">Parent Directory</a>                             -
<a href="class_00/"><img src="/icons/folder.gif" alt="[DIR]"></a> <a href="class_00/">class_00/</a>               2024-01-12 10:00    -
<a href="00017.jpg"><img src="/icons/image2.gif" alt="[IMG]"></a> <a href="00017.jpg">00017.jpg</a>               2024-01-12 10:00  4.0K
<a href="labels.txt"><img src="/icons/text.gif" alt="[TXT]"></a> <a href="labels.txt">labels.txt</a>              2024-01-12 10:01  812
<a href="a%20b&amp;c%c3%a9.jpg"><img src="/icons/image2.gif" alt="[IMG]"></a> <a href="a%20b&amp;c%c3%a9.jpg">a b&amp;cé.jpg</a>         2024-01-12 10:02   17
<a href="shard-000.tar"><img src="/icons/tar.gif" alt="[   ]"></a> <a href="shard-000.tar">shard-000.tar</a>           2024-01-12 10:03  1.2M
<a href="empty.bin"><img src="/icons/unknown.gif" alt="[   ]"></a> <a href="empty.bin">empty.bin</a>               2024-01-12 10:03    0   Zero bytes
<hr></pre>
<address>Apache/2.4.57 (Debian) Server at data.example.com Port 80</address>
</body></html>
"""

APACHE_FILES = {"00017.jpg": -1, "labels.txt": 812, "a%20b&c%c3%a9.jpg": 17, "shard-000.tar": -1, "empty.bin": 0}


@pytest.mark.parametrize("page", [APACHE_TABLE, APACHE_PRE], ids=["HTMLTable", "pre"])
def test_apache_pages_give_exact_sizes_only(page: str) -> None:
    files, folders = _page_links(BASE, page)
    # Exact bytes become sizes; "4.0K" and "1.2M" (approximate: 4,096 +- 51 B) stay unknown,
    # never rounded into a byte count; "&amp;" in an href is the name's "&".
    assert files == {BASE + name: size for name, size in APACHE_FILES.items()}
    assert folders == {BASE + "class_00/"}


def test_apache_without_a_size_column_gives_no_size() -> None:
    # IndexOptions SuppressSize: the column after the date is the description, which may start with digits.
    page = APACHE_PRE.replace('<a href="?C=S;O=A">Size</a>  ', "").replace("  0   Zero bytes", "  42 apples")
    files, _ = _page_links(BASE, page)
    assert files[BASE + "empty.bin"] == -1 and set(files.values()) == {-1}


# nginx's autoindex as a real nginx renders it (exact_size on, the default: right-aligned bytes;
# off: bytes up to 9,999, then "12K", "1M"). The page as served is read in the integration test.
NGINX = (
    '<html>\r\n<head><title>Index of /train/</title></head>\r\n<body>\r\n<h1>Index of /train/</h1><hr><pre>'
    '<a href="../">../</a>\r\n'
    '<a href="class_00/">class_00/</a>                                          03-Dec-2026 02:58                   -\r\n'
    '<a href="a%20b%26c%20%C3%A9.jpg">a b&amp;c \u00e9.jpg</a>                                       03-Dec-2026 02:58'
    '                   1\r\n'
    '<a href="big.bin">big.bin</a>                                            03-Dec-2026 02:58            12345678\r\n'
    '<a href="small.bin">small.bin</a>                                          03-Dec-2026 02:58    512\r\n'
    '<a href="mid.bin">mid.bin</a>                                            03-Dec-2026 02:58     12K\r\n'
    '</pre><hr></body>\r\n</html>\r\n'
)


def test_nginx_rows_give_exact_sizes_only() -> None:
    files, folders = _page_links(BASE, NGINX)
    assert files == {BASE + "a%20b%26c%20%C3%A9.jpg": 1, BASE + "big.bin": 12345678, BASE + "small.bin": 512,
                     BASE + "mid.bin": -1}
    assert folders == {BASE + "class_00/"}


def test_a_page_that_is_no_autoindex_gives_no_size() -> None:
    # Python's http.server lists names only; another page with dates and numbers after its links is no index.
    python_page = ('<title>Directory listing for /train/</title>\n<h1>Directory listing for /train/</h1>\n<hr>\n<ul>\n'
                   '<li><a href="a.jpg">a.jpg</a></li>\n<li><a href="cls/">cls/</a></li>\n</ul>')
    other = NGINX.replace("Index of /train/</h1>", "Our files</h1>").replace("<title>Index of /train/", "<title>Files")
    assert _page_links(BASE, python_page) == ({BASE + "a.jpg": -1}, {BASE + "cls/"})
    files, _ = _page_links(BASE, other)
    assert files and set(files.values()) == {-1}


@pytest.mark.parametrize("odd", [None, *LINKS, "?C=N;O=D", "a&amp;b.jpg"])
def test_a_page_reads_as_its_links_one_by_one(odd: str | None) -> None:
    # A page of plain names is read in one pass (answers.all_plain); one odd link among them
    # sends the whole page through the per-link tests. Either way, the same as each link alone.
    base = "http://h:8080/train/class_00/"
    links = ["00017.jpg", "cls/", "a b.jpg", "deep/er/x.jpg", *([odd] if odd else [])]
    files, folders = _page_links(base, "".join(f'<a href="{link}">x</a>\n' for link in links))
    one_by_one = [_page_links(base, f'<a href="{link}">x</a>') for link in links]
    assert files == {u: s for f, _ in one_by_one for u, s in f.items()}
    assert folders == {u for _, d in one_by_one for u in d}
    assert folders >= {base + "cls/"} and base + "00017.jpg" in files
