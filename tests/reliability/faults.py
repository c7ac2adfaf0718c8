"""The faults the reliability suite injects: one row each of docs/reliability.md.

Each test looks its fault up here, runs exactly ``trials_short`` (``make test``)
or ``trials_full`` (``make test-all``, marked ``slow``) trials, and records what
it measured through the ``record`` fixture (tests/reliability/conftest.py).
``render_doc.py`` renders the table from this registry plus the recorded
results, and ``test_doc_table.py`` fails when docs/reliability.md has drifted
from either, so the table cannot claim what the suite did not run.
"""

from __future__ import annotations

from dataclasses import dataclass

#: With this set to a path, the session merges its trial records into that JSON file.
RESULTS_ENV = "FASTLOAD_RELIABILITY_RESULTS"

AREAS = {
    1: "Flaky remote",
    2: "Crash during pre-staging",
    3: "Crash during training",
    4: "Bit rot",
    5: "Full disk",
    6: "Concurrency",
    7: "Worker death",
    8: "DDP",
    9: "Soak",
    10: "Hostile and bad input",
    11: "Secrets and permissions",
}


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    Attributes:
        id: Stable key (results JSON, test lookups).
        area: Issue area number (see AREAS).
        fault: What goes wrong.
        injection: How the suite makes it go wrong, for real.
        unit: What one trial is.
        trials_short: Trials in ``make test`` (``-m "not slow"``).
        trials_full: Trials in ``make test-all``.
        user_sees: What a user sees when it happens.
    """

    id: str
    area: int
    fault: str
    injection: str
    unit: str
    trials_short: int
    trials_full: int
    user_sees: str


_ALL = [
    Fault(
        "flaky-http", 1,
        "HTTP 503, connection reset mid-body, truncated body, stall longer than the request timeout (each 10% of requests)",
        "FaultProxy (tests/reliability/faultproxy.py) in front of nginx; listing, HEADs and GETs all pass through it",
        "an epoch over a fresh cache", 1, 5,
        "Nothing: each request is retried (full-jitter backoff; here FASTLOAD_RETRIES caps the attempts, else FASTLOAD_RETRY_BUDGET_S bounds them; FASTLOAD_TIMEOUT_S per request); the epoch is bit-exact",
    ),
    Fault(
        "s3-slowdown", 1,
        "S3 throttling: 503 SlowDown on 20% of requests",
        "FaultProxy in front of moto's S3 server, answering with S3's SlowDown XML; s3fs through the proxy",
        "an epoch over a fresh cache", 1, 3,
        "Nothing: botocore, s3fs and fastload retry; the epoch is bit-exact",
    ),
    Fault(
        "store-outage", 1,
        "The store goes down mid-epoch: 8 s (`make test`), 60 s (`make test-all`)",
        "FaultProxy in front of moto's S3 server resets every request, unanswered, from the first batch on for the outage; default settings",
        "an epoch over a fresh cache", 1, 1,
        "One warning naming the host, the cause and retry_budget_s; the epoch waits the outage out and is byte-exact (retries budgeted by time: 300 s per request by default)",
    ),
    Fault(
        "s3-slowdown-storm", 1,
        "S3 throttling storm: 503 SlowDown on 30% of requests (listing, HEADs and GETs)",
        "FaultProxy in front of moto's S3 server, answering with S3's SlowDown XML; default settings; a clean epoch through a fault-free proxy in the same run for the time",
        "an epoch over a fresh cache", 1, 3,
        "Nothing but a slower epoch (the host limit is cut on SlowDown) and one warning: byte-exact",
    ),
    Fault(
        "retries-exhausted", 1,
        "Every request fails (503, or a stall past the timeout)",
        "FaultProxy at 100% 503 and at 100% stall; request times logged by the proxy",
        "a URL read until the attempts run out (503 and stall alternate)", 2, 8,
        "SourceError: '<url>: failed after N attempts in T s; last cause: <503 / no answer within request_timeout_s>; fix: ...' after exactly FASTLOAD_RETRIES requests (the cap set here; unset, retry_budget_s bounds the time), with jittered, capped gaps",
    ),
    Fault(
        "stage-sigkill", 2,
        "`fastload cache` killed with SIGKILL mid-run",
        "SIGKILL at a random point of progress (a random count of new payload files), then rerun",
        "a SIGKILL then a rerun on the same cache", 5, 20,
        "The rerun resumes; `fastload cache --verify` reports 0 bad entries; every item present, bit-exact; no temp file left",
    ),
    Fault(
        "train-sigkill", 3,
        "A training process (2 DataLoader workers) filling the cache is killed with SIGKILL",
        "SIGKILL to the training process group at a random point of the first epoch, then a new run on the same cache",
        "a SIGKILL then a new run on that cache", 2, 6,
        "The new run reuses every valid entry (hits = entries left), refetches only the rest, is not blocked by any lock, temp file or shared-memory name, and reads bit-exact data",
    ),
    Fault(
        "bitrot-flip", 4,
        "Random bytes flipped in 1% of payload files",
        "XOR of 1-4 random bytes anywhere in the file (header, chunk table or body); plus every single-byte flip of small LZ4 and raw payloads",
        "a round of rot over a staged cache, then an epoch", 1, 5,
        "Nothing but a warning naming the URL: 100% detected on read, dropped, refetched, counted (`cache_corrupt` in loader.stats(), 'corrupt' in `fastload info`)",
    ),
    Fault(
        "bitrot-truncate", 4,
        "1% of payload files truncated",
        "truncate() to a random shorter length",
        "a round of rot over a staged cache, then an epoch", 1, 5,
        "As above: 100% detected, refetched, counted",
    ),
    Fault(
        "bitrot-delete", 4,
        "1% of payload files deleted, their index entries left in place",
        "unlink() of the payload file",
        "a round of rot over a staged cache, then an epoch", 1, 5,
        "As above: 100% detected, refetched, counted",
    ),
    Fault(
        "disk-full", 5,
        "The cache disk fills up (the limit is larger than the disk)",
        "A 3 MiB tmpfs mounted as the cache dir (root), a 6 MB dataset, unmounted in teardown",
        "a fresh tmpfs: 2 training epochs, then staging", 1, 3,
        "Training: one warning 'fastload is streaming: ... disk ... is full', data bit-exact, no corrupt entry. `fastload cache`: exit 1, CacheFullError naming the disk, the item and the fix",
    ),
    Fault(
        "concurrency", 6,
        "4 processes x 2 DataLoader workers share one cache whose limit is below the dataset size",
        "4 training processes started together over nginx; disk use sampled every few ms",
        "4 processes x 2 epochs", 1, 3,
        "Correct data in every process, no deadlock, payload bytes on disk never above the limit plus one block",
    ),
    Fault(
        "worker-sigkill", 7,
        "A DataLoader worker process is killed with SIGKILL mid-epoch",
        "os.kill(worker pid, SIGKILL) while the consumer waits in next()",
        "a worker SIGKILLed", 1, 5,
        "torch's RuntimeError 'DataLoader worker (pid N) is killed by signal: Killed' within seconds; never a hang",
    ),
    Fault(
        "source-dies", 7,
        "The remote dies under the read-ahead threads, or stalls",
        "nginx SIGKILLed, or SIGSTOPped, by PID mid-epoch; DataLoader(timeout=3, device='cpu') on the read-ahead thread path and with 2 workers",
        "an epoch, cycling dead/stalled x threads/workers", 4, 8,
        "Dead: SourceError naming the URL, the cause and the fix (from a thread, or re-raised from a worker by torch) within retries x timeout. Stalled: LoaderError 'read_batch did not return within timeout=3 s ... Raise timeout= or check the source' (threads) or torch's 'DataLoader timed out after 3 seconds' (workers), within the timeout",
    ),
    Fault(
        "ddp-rank-dies", 8,
        "One DDP rank dies (SIGKILL) mid-epoch",
        "torchrun --nproc_per_node=2 (and, without an agent, 2 plain processes), gloo on CPU, fastload DataLoader(distributed=True), all_reduce every step; rank 1 SIGKILLs itself at step 3",
        "a 2-rank job, alternating torchrun / no agent", 2, 4,
        "torchrun: the agent stops rank 0 and exits non-zero naming rank 1 and SIGKILL. No agent: rank 0's all_reduce raises gloo's 'Connection reset/closed by peer' at once (or gloo aborts the process with that reason on stderr). Either way within seconds (a 30 s collective timeout as the backstop)",
    ),
    Fault(
        "soak", 9,
        "Many epochs with a cache limit below the dataset (eviction every epoch)",
        "Epochs over nginx with a small cache limit; RSS, open fds and cache dir size sampled per epoch",
        "an epoch", 4, 30,
        "RSS growth < 5% after epoch 2, open fds flat, payload bytes <= limit + one block, index size flat",
    ),
    Fault(
        "fuzz-codec", 10,
        "Corrupt or hostile payload headers and codec input",
        "hypothesis: arbitrary bytes, field-wise mutated headers, flipped payloads; allocation traced with tracemalloc",
        "a hypothesis example per property", 300, 3000,
        "CodecError (never another exception, an over-read or an allocation beyond the bound)",
    ),
    Fault(
        "hostile-names", 10,
        "Tar members with ../ or absolute paths, 300-char paths, symlink, hardlink and device members; remote names with .., NUL, newline, 4000-char names",
        "A crafted tar shard (PAX) read by TarDataset; memory:// objects with such names read through the cache",
        "a hostile member or name", 15, 15,
        "Nothing is extracted or written outside the cache; cache files are hashes; links skipped; data bit-exact",
    ),
    Fault(
        "bad-urls", 10,
        "Malformed URLs, missing credentials, nonexistent bucket or object",
        "fastload.stage / `fastload cache` on each; S3 through moto",
        "a URL or credentials case", 9, 9,
        "A specific error per case (ConfigError, CredentialsError, RemoteNotFoundError) naming the URL, the cause and the fix; CLI exit 1",
    ),
    Fault(
        "corrupt-jpeg", 10,
        "Corrupt JPEG (truncated, garbage, zero bytes) in an image dataset",
        "FileDataset with a user PIL-decode transform (in the loader's threads and in a worker), and through fastload.pipelines.ImageClassification (torch backend, CPU)",
        "a corrupt file", 3, 3,
        "User transform: the decoder's own error, in its original type, with a note naming the URL and that the transform raised there (the file or the transform may be at fault). Pipeline: DecodeError naming the URL and the fix, or on_error='skip' drops the sample and counts decode_skipped",
    ),
    Fault(
        "bad-array-meta", 10,
        "Wrong dtype/shape metadata in .npy headers and token files",
        "Crafted .npy headers (shape larger than the file, overflowing shape, object dtype, Fortran order) and a token file of the wrong dtype",
        "a bad file", 6, 6,
        "DecodeError naming the URL, the header and the fix; object arrays refused, never unpickled",
    ),
    Fault(
        "secrets", 11,
        "Secrets passed in storage_options",
        "A unique secret in S3 credentials and HTTP headers; staging, training, failing calls, DEBUG logs; then grep",
        "a place grepped", 5, 5,
        "The secret is in no cache file, log line, stats output, error message or traceback",
    ),
    Fault(
        "cache-dir-mode", 11,
        "Cache directory permissions under permissive umasks",
        "Cache created under umask 000 and 022; pre-existing 0755 dir",
        "a umask or pre-existing dir", 3, 3,
        "The cache dir is 0700",
    ),
    Fault(
        "no-unpickle", 11,
        "Remote bytes that are a malicious pickle",
        "A pickle that creates a marker file when loaded, served as .pkl, object .npy and tar member; source grep for pickle/torch.load/allow_pickle",
        "a way to serve the pickle", 3, 3,
        "Bytes come back as bytes, object arrays are refused; the marker file never appears",
    ),
]

FAULTS: dict[str, Fault] = {f.id: f for f in _ALL}
