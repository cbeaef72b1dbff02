"""The object-storage client behind the remote tier, one module per concern, imported
from the bottom up:

- ``retry``: which errors are transient, the backoff, the retry loop;
- ``loop``: the background event loop thread and running coroutines on it;
- ``connection``: the fsspec file system opened on that loop, the naming rule, the
  asynchronous requests (size, ranged read, listing, delete);
- ``multipart``: writing one object (single PUT, S3 multipart upload, abort, complete
  retry; temporary file and rename elsewhere) and ObjectWriter;
- ``client``: ObjectStoreClient, the blocking API the engine's threads call.
"""

from ..errors import RemoteError
from .client import ObjectStoreClient
from .connection import check_name
from .multipart import S3_MAX_PART, S3_MAX_PARTS, S3_MIN_PART, ObjectWriter
from .retry import MAX_BACKOFF_S, RetryPolicy, is_transient

__all__ = [
    "MAX_BACKOFF_S",
    "S3_MAX_PART",
    "S3_MAX_PARTS",
    "S3_MIN_PART",
    "ObjectStoreClient",
    "ObjectWriter",
    "RemoteError",
    "RetryPolicy",
    "check_name",
    "is_transient",
]
