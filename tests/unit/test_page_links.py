"""fastload.transport.answers.page_links: what a folder page links to below itself, as urljoin resolves it."""

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
    assert (files | folders) == ({url} if below else set())


def test_plain_names_take_the_fast_join() -> None:
    # The case that costs: an index page of many plain file names (nginx autoindex, http.server).
    assert all(_PLAIN_LINK.match(x) for x in ("00017.jpg", "cls/", "a b.jpg", "deep/er/x.jpg"))
    assert not any(_PLAIN_LINK.match(x) for x in ("./x.jpg", "../up.jpg", "a/../b.jpg", "/abs", "http://o/x", "."))
