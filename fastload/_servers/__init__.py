"""Real servers for fastload's tests, benchmarks and demo.

Nothing here is mocked: :class:`NginxServer` runs the real nginx binary over a
directory (``nginx.py``), :class:`MotoServer` runs moto's S3 server in a thread
(``s3.py``), :class:`GcsEmulator` runs gcp-storage-emulator in a child process (``gcs.py``), and :class:`ShapedLink` builds a network namespace whose loopback
the kernel throttles with ``tc qdisc ... tbf`` (``netns.py``). Import them all
from here.

Reaching a shaped server:
    A :class:`ShapedLink` has its own loopback, so its ``127.0.0.1`` is private
    to the namespace. Python code in the parent namespace *cannot* connect to a
    server started inside it. Start the server with ``netns=link.name`` and run
    the client inside the namespace too, e.g.
    ``link.run_in([sys.executable, "benchmarks/x/bench.py", "--url", url])``,
    so both ends of every connection use the shaped loopback.

Example:
    >>> with ShapedLink(rate="200mbit") as link:             # doctest: +SKIP
    ...     with NginxServer(root, netns=link.name) as http:
    ...         link.run_in(["curl", "-o", "/dev/null", http.url + "/big"])

This package is private: tests, benchmarks and the demo import it; users should not.

Layer: the top, beside ``__main__``; it imports nothing else of fastload, and no module
of fastload imports it.
"""

from fastload._servers.errors import ServerError
from fastload._servers.gcs import GcsEmulator, gcs_emulator_available
from fastload._servers.netns import ShapedLink, shaping_available, shaping_unavailable_reason
from fastload._servers.nginx import NginxServer, find_nginx, nginx_available
from fastload._servers.s3 import (
    MotoServer,
    SignedMotoServer,
    create_bucket,
    moto_available,
    s3_storage_options,
    upload_tree,
)

__all__ = [
    "GcsEmulator",
    "MotoServer",
    "NginxServer",
    "ServerError",
    "ShapedLink",
    "SignedMotoServer",
    "create_bucket",
    "find_nginx",
    "gcs_emulator_available",
    "moto_available",
    "nginx_available",
    "s3_storage_options",
    "shaping_available",
    "shaping_unavailable_reason",
    "upload_tree",
]
