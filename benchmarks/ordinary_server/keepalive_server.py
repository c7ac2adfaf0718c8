"""The standard library's ThreadingHTTPServer (listen backlog 5) with a handler that speaks
HTTP/1.1 keep-alive and answers a single Range with a 206, as a user who reads the
http.server docs and adds Range support would write it. Run: ``python keepalive_server.py PORT DIR``.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import sys
from typing import Any

RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer carries a Content-Length
    _left: int | None = None  # bytes of the range still to send

    def send_head(self) -> Any:
        path = self.translate_path(self.path)
        match = RANGE.fullmatch((self.headers.get("Range") or "").strip())
        if match is None or os.path.isdir(path):
            return super().send_head()
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the handler after copyfile
        except OSError:
            self.send_error(404, "File not found")
            return None
        st = os.fstat(f.fileno())
        start, end = int(match[1]), min(int(match[2]) if match[2] else st.st_size - 1, st.st_size - 1)
        if start >= st.st_size:
            f.close()
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{st.st_size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{st.st_size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
        self.end_headers()
        self._left = end - start + 1
        return f

    def copyfile(self, source: Any, outputfile: Any) -> None:
        left, self._left = self._left, None
        if left is None:
            super().copyfile(source, outputfile)
            return
        while left > 0:
            buf = source.read(min(left, 64 * 1024))
            if not buf:
                break
            outputfile.write(buf)
            left -= len(buf)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet, as the benchmark's http.server
        pass


if __name__ == "__main__":
    port, root = int(sys.argv[1]), sys.argv[2]
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Handler, directory=root)) as httpd:
        httpd.serve_forever()
